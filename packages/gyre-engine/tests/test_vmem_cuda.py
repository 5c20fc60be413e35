"""Device memory whose addresses outlive a release (`server/vmem.py`): a region gives its memory back to
the driver and maps new memory at the same addresses; the weights moved into one keep their layout and
come back where they were; an engine's decode graphs captured before a release replay after it (none
captured again) and decode what they did, and with the addresses not kept they are captured again.
Skipped without CUDA (the driver's virtual memory API has no CPU counterpart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the shared checks (tests run with --import-mode=importlib)
import slot_checks  # noqa: E402
from gyre_engine.server import vmem  # noqa: E402
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False  # the engine's greedy tokens against transformers'
torch.backends.cudnn.allow_tf32 = False
DEV = torch.device("cuda", 0)
MIB = 1 << 20

if not vmem.supported(DEV):
    pytest.skip("this GPU's driver has no virtual memory management", allow_module_level=True)


def _free() -> int:
    torch.cuda.synchronize(DEV)
    return torch.cuda.mem_get_info(DEV)[0]


def test_region_gives_memory_back_and_keeps_its_addresses() -> None:
    r = vmem.DeviceRegion(256 * MIB + 5, DEV)
    try:
        assert r.mapped and r.nbytes >= 256 * MIB + 5 and r.maps == 1
        t = r.tensor(torch.float32, (1024, 1024), offset=4096)
        t.copy_(torch.arange(1024 * 1024, device=DEV, dtype=torch.float32).view(1024, 1024))
        assert t.data_ptr() == r.ptr + 4096 and float(t[3, 5]) == 3 * 1024 + 5
        free_mapped = _free()
        r.unmap()
        assert not r.mapped
        assert _free() - free_mapped >= r.nbytes - 8 * MIB  # the driver has the memory back
        r.map()
        assert r.maps == 2 and free_mapped - _free() < 8 * MIB
        again = r.tensor(torch.float32, (1024, 1024), offset=4096)
        assert again.data_ptr() == t.data_ptr()
        again.fill_(2.0)
        assert float(t.sum()) == 2.0 * 1024 * 1024  # the old view reads the new memory
        with pytest.raises(ValueError, match="do not fit"):
            r.tensor(torch.float32, (r.nbytes,))
    finally:
        r.close()
    with pytest.raises(vmem.VmemError, match="closed"):
        r.map()


def test_region_larger_than_the_gpu_is_an_out_of_memory_error() -> None:
    total = torch.cuda.get_device_properties(DEV).total_memory
    with pytest.raises(torch.OutOfMemoryError, match="cuMemCreate"):
        vmem.DeviceRegion(2 * total, DEV)


def test_kept_weights_keep_layout_and_addresses() -> None:
    base = torch.randn(64, 32, device=DEV)
    head = torch.nn.Parameter(base[:16])  # views of one storage stay views of one place
    tail = torch.nn.Parameter(base[16:].t())  # a transposed view keeps its strides
    other = torch.nn.Parameter(torch.randn(7, device=DEV, dtype=torch.bfloat16))
    want = [base.clone(), head.detach().clone(), tail.detach().clone(), other.detach().clone()]
    k = vmem.KeptWeights([base, head, tail, other, head], DEV)
    try:
        assert len(k.tensors) == 4
        ptrs = [t.data_ptr() for t in (base, head, tail, other)]
        assert ptrs[0] == k.region.ptr and ptrs[1] == ptrs[0] and ptrs[2] == ptrs[0] + 16 * 32 * 4
        assert ptrs[3] % 256 == 0 and ptrs[3] >= ptrs[0] + 64 * 32 * 4
        assert tail.stride() == (1, 32) and tail.shape == (32, 48)
        for t, w in zip((base, head, tail, other), want, strict=True):
            assert torch.equal(t, w)
        head.data.add_(1.0)  # writes through the view land in the shared place
        assert torch.equal(base[:16], want[1] + 1.0)
        free_kept = _free()
        k.release()
        assert all(t.device.type == "cpu" for t in (base, head, tail, other))
        assert torch.equal(head, want[1].cpu() + 1.0) and torch.equal(tail, want[2].cpu())
        assert head.data_ptr() == base.data_ptr()  # still one storage on the host
        assert _free() > free_kept
        k.restore()
        assert [t.data_ptr() for t in (base, head, tail, other)] == ptrs
        assert torch.equal(other, want[3]) and torch.equal(base[16:], want[2].t())
    finally:
        k.close()


def _engine(model_dir: Path, keep: bool) -> Engine:
    cfg = Engine.Config(
        max_running_requests=8,
        decode_slots="graphs",
        compile_decode=False,
        slot_widths="full",
        slot_max_len=256,
        long_context_tokens=512,
        long_context_slots=2,
        keep_graphs=keep,
    )
    return load_engine(ServeConfig(model=str(model_dir), device="cuda", engine=cfg))


@pytest.mark.parametrize("keep", [True, False])
def test_decode_graphs_outlive_a_release(model_dir: Path, keep: bool) -> None:
    """Greedy rows in the decode slots and one past them (the long slots) before and after a release of
    the weights and the KV cache: the same tokens, the same transformers reference, and with the
    addresses kept no graph captured again while the released engine gave its memory back."""
    ref = slot_checks.load_hf(model_dir).to("cuda")
    e = _engine(model_dir, keep)
    try:
        assert (e.kept is not None) == keep
        e.call(e.warmup_decode, 256).result(300)
        long_prompt = [1000 + (7 * i) % 900 for i in range(300)]  # past a 256-token decode slot
        reqs: list[tuple[list[int], Any]] = [
            (slot_checks.SYSTEM + slot_checks.USER, slot_checks.greedy_params(24)),
            (slot_checks.TOOL, slot_checks.greedy_params(17)),
            (long_prompt, slot_checks.greedy_params(20)),
        ]
        first = [o["ids"] for o in slot_checks.run_all(e, reqs)]
        st0 = e.slot_stats()
        ptrs = [p.data_ptr() for p in e.model.parameters()]
        free_serving = _free()
        e.call(e.release_memory, None).result(60)
        freed = _free() - free_serving
        e.call(e.resume_memory, None).result(60)
        again = [o["ids"] for o in slot_checks.run_all(e, reqs)]
        st1 = e.slot_stats()
    finally:
        e.shutdown()
    for (ids, sp), got in zip(reqs, first, strict=True):
        assert got == slot_checks.reference_greedy(ref, ids, sp.max_new_tokens)
    assert again == first
    assert st0["long_replays"] > 0 and st1["long_replays"] > st0["long_replays"], st1
    weights = sum(p.numel() * p.element_size() for p in e.model.parameters())
    assert freed >= weights, (freed, weights)  # the weights' and slots' memory went back to the driver
    if keep:
        assert [p.data_ptr() for p in e.model.parameters()] == ptrs
        assert st1["captures"] == st0["captures"] and st1["long_captures"] == st0["long_captures"], (st0, st1)
        assert st1["replays"] > st0["replays"]
    else:
        assert st1["captures"] > st0["captures"], (st0, st1)


def test_weights_stay_movable_where_two_copies_do_not_fit(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Moving the weights to kept addresses holds both copies for a moment: where the GPU lacks the room
    the engine keeps them where they are (a warning says so) and serves, releases and resumes as without
    kept addresses."""
    from gyre_engine.server import engine as engine_mod

    monkeypatch.setattr(engine_mod, "KEEP_MARGIN", 1 << 50)
    e = _engine(model_dir, keep=True)
    try:
        assert e.kept is None
        assert "weights not moved to kept device addresses" in caplog.text
        reqs: list[tuple[list[int], Any]] = [(slot_checks.USER, slot_checks.greedy_params(12))]
        first = [o["ids"] for o in slot_checks.run_all(e, reqs)]
        e.call(e.release_memory, None).result(60)
        e.call(e.resume_memory, None).result(60)
        assert [o["ids"] for o in slot_checks.run_all(e, reqs)] == first
    finally:
        e.shutdown()
