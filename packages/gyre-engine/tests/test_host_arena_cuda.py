"""The host tier's arena on a GPU: its buffer page-locked once (torch's `is_pinned` on the views a spilled
entry is read from), device KV placed and read back bit for bit, a prefix cache whose device budget
spills to it serving the same KV, and the span reused once its entry and leases are gone. Skipped
without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gyre_engine.server.batch import RowKV  # noqa: E402
from gyre_engine.server.host_arena import HostArena  # noqa: E402
from gyre_engine.server.prefix_cache import PrefixCache  # noqa: E402
from gyre_xfer.pinning import host_pinning  # noqa: E402


def device_kv(n: int, layers: int = 4, seed: int = 0) -> RowKV:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def plane() -> torch.Tensor:
        return torch.randn((1, 8, n, 128), generator=g, device="cuda", dtype=torch.bfloat16)

    return RowKV([plane() for _ in range(layers)], [plane() for _ in range(layers)])


def test_the_arena_is_page_locked_and_round_trips_device_kv() -> None:
    src = device_kv(1000)
    arena = HostArena(3 * src.nbytes(), host_pinning("cuda"))
    got = arena.place(src)
    assert arena.pinned and got is not None
    assert all(t.is_pinned() and t.device.type == "cpu" for t in (*got.keys, *got.values))
    back = [t.to("cuda") for t in (*got.keys, *got.values)]
    assert all(torch.equal(a, b) for a, b in zip(back, (*src.keys, *src.values), strict=True))
    arena.release(got)
    assert arena.free_bytes() == arena.nbytes


def test_a_prefix_cache_spills_device_kv_to_its_page_locked_tier() -> None:
    cache = PrefixCache(1000, host_tokens=2000, pinning=host_pinning("cuda"))
    cache.reserve_host(device_kv(1).nbytes())
    assert cache.host_pinned and cache.host_bytes == 2000 * device_kv(1).nbytes()
    kvs = {t: device_kv(1000, seed=t) for t in (1, 2, 3)}
    for t, kv in kvs.items():  # 1 then 2 leave the device for the host
        cache.insert([t] * 1000, kv)
    assert cache.host_held_tokens == 2000
    hit = cache.lookup([1] * 1000 + [0], 1000)
    assert hit.on_host and hit.kv is not None and hit.kv.keys[0].is_pinned()
    assert torch.equal(hit.kv.keys[3].to("cuda"), kvs[1].keys[3])
    del hit
    cache.evict(1000)  # 3 to the host: 2, least recently used (1 was just read) and read by none, makes room
    assert cache.lookup([2] * 1000 + [0], 1000).length == 0
    hit1 = cache.lookup([1] * 1000 + [0], 1000)
    assert hit1.on_host and hit1.kv is not None
    assert torch.equal(hit1.kv.keys[3].to("cuda"), kvs[1].keys[3])
    hit3 = cache.lookup([3] * 1000 + [0], 1000)
    assert hit3.on_host and hit3.kv is not None
    assert torch.equal(hit3.kv.values[2].to("cuda"), kvs[3].values[2])
