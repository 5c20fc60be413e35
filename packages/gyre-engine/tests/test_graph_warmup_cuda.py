"""The decode warm-up captures the graphs that rows sampled at their temperature replay, so an RL
rollout (every row sampled) captures none in the middle of decoding: each capture runs the step twice
eagerly and once under capture, about a second for a 28-layer model, during which every running row
waits. With the head kernels one graph serves greedy and sampled rows; without them (the torch head) the
warm-up captures a sampled graph beside each greedy one. Skipped without CUDA."""

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
from gyre_engine.protocol import SamplingParams  # noqa: E402
from gyre_engine.server import head  # noqa: E402
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402


def _sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=seed)


@pytest.mark.parametrize("kernel_head", [True, False])
def test_warmup_covers_sampled_rows(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, kernel_head: bool
) -> None:
    if not kernel_head:
        monkeypatch.setattr(head, "available", lambda device: False)
    elif not head.available(torch.device("cuda")):
        pytest.skip("no Triton: the head kernels do not run here")
    cfg = Engine.Config(max_running_requests=8, decode_slots="graphs", compile_decode=False)
    e = load_engine(ServeConfig(model=str(model_dir), device="cuda", engine=cfg))
    try:
        e.call(e.warmup_decode, 128).result(300)
        warm = e.slot_stats()
        reqs: list[tuple[list[int], Any]] = [
            (slot_checks.SYSTEM[: 8 + 3 * i], _sampled(24 + 2 * i, seed=i)) for i in range(5)
        ]
        reqs.append((slot_checks.USER, slot_checks.greedy_params(20)))
        outs = slot_checks.run_all(e, reqs)
        after = e.slot_stats()
    finally:
        e.shutdown()
    assert [len(o["ids"]) for o in outs] == [24, 26, 28, 30, 32, 20]
    assert warm["captures"] > 0
    assert after["captures"] == warm["captures"], (warm, after)  # nothing captured while rows ran
    assert after["replays"] > warm["replays"] and after["run_steps"] > warm["run_steps"], after
    assert after["eager_steps"] == warm["eager_steps"], after  # every step replayed a graph
