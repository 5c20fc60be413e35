"""`gyre-train core` trains `gyre-traj pack` output, checkpoints after each step and resumes at the
queue position it reached; with `--model DIR` it trains a model directory's model from its weights, and
refuses a directory it does not build exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gyre_base.testing import free_port
from gyre_train.cli import main
from gyre_traj.cli import main as traj_main

EXAMPLE = Path(__file__).parents[2] / "gyre-traj" / "examples" / "branching.jsonl"


def test_core_trains_packed_dirs_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = []
    for k, budget in enumerate((4096, 2048)):
        d = tmp_path / f"packed-{k}"
        assert traj_main(["pack", str(EXAMPLE), "--out", str(d), "--budget", str(budget)]) == 0
        dirs.append(str(d))
    capsys.readouterr()
    ck = tmp_path / "ck"
    args = ["core", "--data", dirs[0], "--budget", "4096", "--checkpoint", str(ck)]
    assert main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["version"] == 0 and lines[1]["step"] == 1 and lines[1]["queue_position"] == 1
    mismatch = lines[1]["mismatch"]  # the example's recorded logprobs are not this random model's
    assert mismatch["tokens"] == lines[1]["metrics"]["tokens"] and mismatch["abs_mean"] > 0.1
    # Resume with a longer queue: it starts where it stopped (position 1), not from the beginning.
    assert (
        main(["core", "--data", *dirs, "--budget", "4096", "--checkpoint", str(ck), "--tis-cap", "1.5"]) == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["version"] == 1
    assert [x["step"] for x in lines[1:]] == [2]
    assert json.loads((ck / "state.json").read_text())["queue_position"] == 2


def test_core_trains_what_the_feed_submits(tmp_path: Path) -> None:
    import threading

    from gyre_train.control import CoreClient
    from gyre_train.data import synthetic_minibatch

    addr = f"tcp://127.0.0.1:{free_port()}"
    rc: list[int] = []
    args = [
        "core",
        "--feed",
        "--steps",
        "1",
        "--bind",
        addr,
        "--budget",
        "512",
        "--checkpoint",
        str(tmp_path / "ck"),
    ]
    th = threading.Thread(target=lambda: rc.append(main(args)), daemon=True)
    th.start()
    feeder = CoreClient(addr, timeout_s=60)
    try:
        assert feeder.status().queue_position == 0
        feeder.submit(0, synthetic_minibatch(2, seed=1))
    finally:
        feeder.close()
    th.join(timeout=120)
    assert rc == [0]
    assert json.loads((tmp_path / "ck" / "state.json").read_text())["queue_position"] == 1


def test_core_trains_a_model_directory_and_refuses_one_it_does_not_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("gyre_engine.server")
    import sys

    import torch
    from gyre_train.checkpoint import load

    sys.path.insert(0, str(Path(__file__).parent))  # shared helpers (tests run with --import-mode=importlib)
    import family_dirs
    from safetensors.torch import load_file

    d = family_dirs.family_dir(tmp_path / "llama", "llama", vocab_size=8192)  # room for synthetic ids
    ck = tmp_path / "ck"
    assert (
        main(["core", "--model", str(d), "--synthetic", "1", "--budget", "1024", "--checkpoint", str(ck)])
        == 0
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[1]["version"] == 1 and lines[1]["grad_norm"] > 0
    state = load(ck)
    assert state["model_config"]["hf"] == json.loads((d / "config.json").read_text())
    start = load_file(
        str(d / "model.safetensors")
    )  # trained from the directory's weights: one small step away
    for name, t in start.items():
        assert (state["model"][name] - t).abs().max() < 1e-2, name
    assert any(not torch.equal(state["model"][n], t) for n, t in start.items())
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    assert main(["core", "--model", str(d), "--synthetic", "1"]) == 2
    assert "use_sliding_window = true" in capsys.readouterr().err
