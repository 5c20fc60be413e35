"""The KV prefix hand-off's two sides in one process (an offering `XferHub` and an importing one, each with
its own shared-memory transport, as two engines have): the pulled KV equals the offered KV exactly, an
offer's arena is reused only after a receipt for every block, and an importer reading a released and
reused arena is refused instead of installing another prefix's KV."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch
from gyre_engine.protocol import OfferPrefixRequest, PrefixOffer
from gyre_engine.server.batch import RowKV
from gyre_engine.server.xfer import KvPullError, XferHub
from gyre_xfer.protocol import KvOffer
from gyre_xfer.shm import SHM_DIR

LAYERS = 3


def kv_of(seed: int, heads: int, n: int, dim: int = 8) -> RowKV:
    g = torch.Generator().manual_seed(seed)

    def plane() -> torch.Tensor:
        return torch.randn(1, heads, n, dim, generator=g).to(torch.bfloat16)

    return RowKV([plane() for _ in range(LAYERS)], [plane() for _ in range(LAYERS)])


def segment(offer: PrefixOffer) -> str:
    return msgspec.json.decode(offer.kv_offer, type=KvOffer).pool.regions[0].shm_name


def same(a: RowKV, b: RowKV) -> bool:
    return all(torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True))


@pytest.fixture
def hubs():  # type: ignore[no-untyped-def]
    src, dst = XferHub(), XferHub()
    yield src, dst
    src.close()
    dst.close()


def offer(hub: XferHub, kv: RowKV, block_tokens: int = 4) -> PrefixOffer:
    ids = list(range(kv.length))
    return hub.offer(OfferPrefixRequest(ids, block_tokens=block_tokens), ids, kv, "fp", "v0")


def pull(hub: XferHub, o: PrefixOffer) -> tuple[RowKV, list[int]]:
    kv, res = hub.pull_prefix(o, LAYERS, torch.device("cpu"), 10.0)
    assert res.ok and res.nbytes > 0
    return kv, [b.src_block for b in res.blocks]


@pytest.mark.parametrize("heads", [1, 4])  # one head: the transposed plane is already contiguous
def test_reused_arena_carries_the_new_prefix_and_leaves_the_old_import_intact(
    hubs: tuple[XferHub, XferHub], heads: int
) -> None:
    src, dst = hubs
    first, second = kv_of(1, heads, 10), kv_of(2, heads, 9)  # 9 tokens: the last block half used
    o1 = offer(src, first)
    got1, arrived = pull(dst, o1)
    assert same(got1, first)
    assert src.release(o1.offer_id, arrived)  # the receipt names every block: the arena is kept
    o2 = offer(src, second)
    assert segment(o2) == segment(o1)  # the same shared memory, written again
    got2, arrived = pull(dst, o2)
    assert same(got2, second)
    assert same(got1, first)  # the first import owns its memory: the arena's reuse did not touch it
    src.release(o2.offer_id, arrived)


def test_importer_of_a_released_offer_is_refused_once_the_arena_is_reused(
    hubs: tuple[XferHub, XferHub],
) -> None:
    src, dst = hubs
    o1 = offer(src, kv_of(1, 2, 12))
    _, arrived = pull(dst, o1)
    src.release(o1.offer_id, arrived)
    o2 = offer(src, kv_of(2, 2, 12))
    with pytest.raises(KvPullError, match="released") as ei:
        dst.pull_prefix(o1, LAYERS, torch.device("cpu"), 10.0)  # its arena now holds o2's KV
    assert ei.value.status == 409
    got, _ = pull(dst, o2)
    assert same(got, kv_of(2, 2, 12))


def test_an_offer_released_without_a_full_receipt_is_freed_not_reused(hubs: tuple[XferHub, XferHub]) -> None:
    src, dst = hubs
    kv = kv_of(3, 2, 12)
    o1 = offer(src, kv)
    assert src.release(o1.offer_id, [0])  # one of three blocks: the importer may still be reading
    assert not os.path.exists(os.path.join(SHM_DIR, segment(o1)))
    o2 = offer(src, kv)
    assert segment(o2) != segment(o1)
    got, _ = pull(dst, o2)
    assert same(got, kv)
    # a pull of the freed offer finds its segment gone
    with pytest.raises(KvPullError) as ei:
        dst.pull_prefix(o1, LAYERS, torch.device("cpu"), 10.0)
    assert ei.value.status == 502


def test_spare_arenas_stay_within_their_budget(hubs: tuple[XferHub, XferHub]) -> None:
    src, dst = hubs
    src.config.kv_spare_bytes = 0  # nothing kept: every offer gets new memory, freed on release
    o1 = offer(src, kv_of(4, 2, 8))
    _, arrived = pull(dst, o1)
    src.release(o1.offer_id, arrived)
    assert not os.path.exists(os.path.join(SHM_DIR, segment(o1)))
    o2 = offer(src, kv_of(4, 2, 8))
    assert segment(o2) != segment(o1)
    src.release(o2.offer_id)


def test_an_offer_whose_copy_fails_frees_its_arena(hubs: tuple[XferHub, XferHub]) -> None:
    src, _ = hubs
    mine = f"gyre-{os.getpid()}-"
    before = {f for f in os.listdir(SHM_DIR) if f.startswith(mine)}
    good = kv_of(5, 2, 8)
    bad = RowKV(good.keys, [torch.zeros(1, 3, 8, 8, dtype=torch.bfloat16) for _ in range(LAYERS)])  # 3 heads
    with pytest.raises(RuntimeError):
        offer(src, bad)
    assert {f for f in os.listdir(SHM_DIR) if f.startswith(mine)} == before


@pytest.mark.parametrize("block_tokens", [10, 11, 2**63 - 1])
def test_a_block_larger_than_the_prefix_is_one_block_of_the_prefix(
    hubs: tuple[XferHub, XferHub], block_tokens: int
) -> None:
    """A block of more tokens than the prefix holds it whole: the offer says blocks of the prefix's size,
    and the import equals it. (2^63 - 1, which the fuzz test sent, made the pool's size overflow: a 500.)"""
    src, dst = hubs
    kv = kv_of(3, 2, 10)
    o = offer(src, kv, block_tokens)
    assert o.block_tokens == 10 and len(msgspec.json.decode(o.kv_offer, type=KvOffer).block_ids) == 1
    got, arrived = pull(dst, o)
    assert same(got, kv) and src.release(o.offer_id, arrived)
    with pytest.raises(ValueError, match="at least 1"):
        offer(src, kv, 0)
