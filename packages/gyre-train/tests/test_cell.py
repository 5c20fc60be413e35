"""Cells that are multi-rank jobs (gloo on the CPU, two ranks each, started by `gyre_train.launch`)
against one rank in this process:

- Megatron-core tensor parallel 2: the tree-packed loss and summed gradient of a mini-batch equal one
  rank's within float tolerance; a TP 2 satellite cell whose rank r hands its shard to core rank r (over
  gyre-xfer) leaves the summed gradient as the core alone computes it; so does a one-rank satellite
  whose whole gradients each core rank splits as its parameters are split; the transformers export
  gathered from the shards equals one rank's export bit for bit.
- Megatron-core pipeline parallel 2: the same loss, gradient and export checks, stages exchanging
  activations with Megatron's P2PCommunicator.
- The transformers backend with data parallel 2, core and satellite (of two copies, or one rank): a
  two-step burst with the satellite joining mid-step gives one rank's weights bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).parent
sys.path.insert(
    0, str(HERE)
)  # the cell program's shared definitions (tests run with --import-mode=importlib)
import cell_prog  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning"),
]


def launch(nproc: int, preload: str, target: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)  # the launcher picks a free one
    cmd = [sys.executable, "-m", "gyre_train.launch", "--nproc", str(nproc), "--preload", preload, *target]
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)


def finish(procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for p, log in zip(procs, logs, strict=True):
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"{log.name} exited {rc}:\n{log.read_text()[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def address(out: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (out / "core.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"core cell did not start (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return str(json.loads((out / "core.json").read_text())["address"])


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[k] - want[k]).abs().max()) for k in want) / scale


@pytest.fixture(scope="module")
def megatron_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One rank in this process: the weights every cell loads, and its loss, gradient and export."""
    pytest.importorskip("gyre_train.megatron")
    from gyre_train.core import Core
    from gyre_train.model import build_model

    tmp = tmp_path_factory.mktemp("megatron-ref")
    mc = cell_prog.model_config("megatron")
    ref = Core(build_model(mc), mc, cell_prog.core_config("float32"))
    try:
        save_file(
            {k: v.contiguous() for k, v in ref.whole_weights().items()}, str(tmp / "weights.safetensors")
        )
        g = ref.gradient(cell_prog.A)
        hf = ref.hf_weights()
    finally:
        ref.close()
    return tmp / "weights.safetensors", g.loss, g.gradient, hf


def test_tensor_parallel_2_core_and_satellite_equal_one_rank(
    tmp_path: Path, megatron_reference: tuple[Path, float, dict[str, torch.Tensor], dict[str, torch.Tensor]]
) -> None:
    weights, loss, grad, hf = megatron_reference
    logs = [tmp_path / "core.log", tmp_path / "satellite.log"]
    core = launch(2, "megatron", [str(HERE / "cell_prog.py"), "--tp", "2", "--weights", str(weights),
                                  "--satellite", "sat-tp", "--out", str(tmp_path)], logs[0])  # fmt: skip
    sat = launch(2, "megatron", ["-m", "gyre_train.cli", "satellite", "--core", address(tmp_path, core, logs[0]),
                                 "--name", "sat-tp", "--tp", "2"], logs[1])  # fmt: skip
    finish([core, sat], logs)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    tp2 = load_file(str(tmp_path / "grad.safetensors"))
    err = max_rel_err(tp2, grad)
    print(f"TP 2 vs TP 1: loss {result['loss']!r} vs {loss!r}, gradient max relative error {err:.2e}")
    assert err < 1e-5
    # The satellite cell computed some micro-batches; its shards, read rank to rank, leave the sum as is.
    assert result["satellite_gradients"] >= 1
    with_sat = load_file(str(tmp_path / "grad_with_satellite.safetensors"))
    assert max_rel_err(with_sat, tp2) < 1e-6
    assert result["loss_with_satellite"] == pytest.approx(result["loss"], rel=1e-6)
    # Weights made whole from the shards, and their transformers export, are one rank's bit for bit.
    for name, want in (("weights", load_file(str(weights))), ("hf", hf)):
        got = load_file(str(tmp_path / f"{name}.safetensors"))
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)


def test_one_rank_satellite_beside_tensor_parallel_2_core_equals_one_rank(
    tmp_path: Path, megatron_reference: tuple[Path, float, dict[str, torch.Tensor], dict[str, torch.Tensor]]
) -> None:
    # A one-rank satellite (whole weights from the core's whole-model publisher) hands its whole
    # gradients; each TP 2 core rank adds its own shard of them (column/row parallel, the fused QKV and
    # SwiGLU halves, the q/k layer norms once): the step's gradient is one rank's on all micro-batches.
    weights, loss, grad, _ = megatron_reference
    logs = [tmp_path / "core.log", tmp_path / "satellite.log"]
    core = launch(2, "megatron", [str(HERE / "cell_prog.py"), "--tp", "2", "--weights", str(weights),
                                  "--satellite", "sat-1", "--out", str(tmp_path)], logs[0])  # fmt: skip
    sat = launch(1, "megatron", ["-m", "gyre_train.cli", "satellite", "--core", address(tmp_path, core, logs[0]),
                                 "--name", "sat-1"], logs[1])  # fmt: skip
    finish([core, sat], logs)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["satellite_gradients"] >= 1  # the satellite computed some of the micro-batches
    with_sat = load_file(str(tmp_path / "grad_with_satellite.safetensors"))
    err = max_rel_err(with_sat, grad)
    print(f"TP 2 core + TP 1 satellite vs one rank: gradient max relative error {err:.2e}")
    assert err < 1e-5
    assert result["loss_with_satellite"] == pytest.approx(loss, rel=1e-6)


def test_tensor_parallel_2_checkpoint_is_one_ranks_and_resumes_exactly(
    tmp_path: Path, megatron_reference: tuple[Path, float, dict[str, torch.Tensor], dict[str, torch.Tensor]]
) -> None:
    # A TP 2 core trains A, checkpoints (rank 0 gathers the weights and AdamW moments into the one-rank
    # layout), trains B; then loads the checkpoint (every rank takes its part) and trains B again.
    from gyre_train import checkpoint
    from gyre_train.core import Core
    from gyre_train.model import build_model

    weights = megatron_reference[0]
    log = tmp_path / "core.log"
    core = launch(2, "megatron", [str(HERE / "cell_prog.py"), "--tp", "2", "--weights", str(weights),
                                  "--resume", "--out", str(tmp_path)], log)  # fmt: skip
    finish([core], [log])
    result = json.loads((tmp_path / "result.json").read_text())
    uninterrupted = load_file(str(tmp_path / "uninterrupted.safetensors"))
    resumed = load_file(str(tmp_path / "resumed.safetensors"))
    assert result["loss_resumed"] == result["loss"]
    for k in uninterrupted:  # the same ranks from the same state: the same floats
        assert torch.equal(resumed[k], uninterrupted[k]), k
    assert any(not torch.equal(uninterrupted[k], v) for k, v in load_file(str(weights)).items())  # it trained

    # The checkpoint is the one-rank core's after A (its layout, weights and AdamW moments), and a
    # one-rank core resumes from it to the TP 2 core's weights after B.
    mc = cell_prog.model_config("megatron")
    ref = Core(build_model(mc), mc, cell_prog.core_config("float32"))
    try:
        ref.load_whole_weights(load_file(str(weights)))
        ref.train_burst([cell_prog.A])
        want = ref.state_dict()
        got = checkpoint.load(tmp_path / "ckpt")
        assert got["layout"] == want["layout"] and got["position"] == want["position"]
        assert max_rel_err(got["model"], {k: v.clone() for k, v in want["model"].items()}) < 1e-6
        for key in ("exp_avg", "exp_avg_sq"):
            err = max_rel_err(
                {n: st[key] for n, st in got["optimizer"]["state"].items()},
                {n: st[key].clone() for n, st in want["optimizer"]["state"].items()},
            )
            print(f"TP 2 checkpoint vs one rank: {key} max relative error {err:.2e}")
            assert err < 1e-5
        assert all(float(st["step"]) == 1.0 for st in got["optimizer"]["state"].values())
        ref.load(tmp_path / "ckpt")
        ref.train_burst([cell_prog.B])
        after = ref.whole_weights()
        moved = {k: uninterrupted[k] - got["model"][k] for k in uninterrupted}
        err = max_rel_err({k: after[k] - got["model"][k] for k in moved}, moved)
        print(f"one rank resumed from the TP 2 checkpoint: update max relative error {err:.2e}")
        assert err < 1e-3
    finally:
        ref.close()


def test_pipeline_parallel_2_equals_one_rank(
    tmp_path: Path, megatron_reference: tuple[Path, float, dict[str, torch.Tensor], dict[str, torch.Tensor]]
) -> None:
    weights, loss, grad, hf = megatron_reference
    log = tmp_path / "core.log"
    core = launch(2, "megatron", [str(HERE / "cell_prog.py"), "--pp", "2", "--weights", str(weights),
                                  "--out", str(tmp_path)], log)  # fmt: skip
    finish([core], [log])
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    err = max_rel_err(load_file(str(tmp_path / "grad.safetensors")), grad)
    print(f"PP 2 vs PP 1: gradient max relative error {err:.2e}")
    assert err < 1e-5
    got = load_file(str(tmp_path / "hf.safetensors"))
    assert got.keys() == hf.keys() and all(torch.equal(got[k], hf[k]) for k in hf)


@pytest.mark.parametrize(
    "sat_dp",
    [pytest.param(2, marks=pytest.mark.long, id="dp2-satellite"), pytest.param(1, id="one-rank-satellite")],
)
def test_data_parallel_2_core_and_satellite_equal_one_rank(tmp_path: Path, sat_dp: int) -> None:
    # A satellite of the core's shape hands each copy its slice; a one-rank satellite hands its whole
    # gradient, of which each copy takes its slice: the weights are one rank's bit for bit either way.
    from gyre_train.core import Core
    from gyre_train.model import build_model

    mc = cell_prog.model_config("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs: a CPU kernel's sums may split by thread count
    ref = Core(build_model(mc), mc, cell_prog.core_config("float32"))
    try:
        ref.train_burst([cell_prog.A, cell_prog.B])
        want = {k: v.clone() for k, v in ref.whole_weights().items()}
    finally:
        ref.close()
        torch.set_num_threads(threads)
    logs = [tmp_path / "core.log", tmp_path / "satellite.log"]
    core = launch(2, "transformers", [str(HERE / "cell_prog.py"), "--dp", "2", "--model-backend", "transformers",
                                      "--satellite", "sat-dp", "--burst", "--out", str(tmp_path)], logs[0])  # fmt: skip
    sat = launch(sat_dp, "transformers", ["-m", "gyre_train.cli", "satellite", "--core", address(tmp_path, core, logs[0]),
                                          "--name", "sat-dp", "--dp", str(sat_dp)], logs[1])  # fmt: skip
    finish([core, sat], logs)
    result = json.loads((tmp_path / "result.json").read_text())
    assert sum(r.get("sat-dp", 0) for r in result["by_replica"]) >= 1  # the satellite cell computed some
    got = load_file(str(tmp_path / "weights.safetensors"))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
