"""`gyre demo --quick`: the whole path on real processes (warm start into the cache, RL on two cells under
the elastic policy, held-out evaluations, outputs). Too short to learn anything: it checks that every
output is written and consistent, not the figures (those are in the README); and that a second demo on
its directory shows its results and leaves it as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.cli import main
from gyre.rollout.tasks.qa import FAMILIES

from .runcheck import assert_no_fault


@pytest.mark.slow
def test_quick_demo_writes_every_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--seed", "1"]) == 0
    d = json.loads((out / "demo.json").read_text())
    for key in ("eval_before", "eval_after", "train_score_first", "train_score_last", "steps",
                "model_tool_call_share", "warmstart_s", "wall_s"):  # fmt: skip
        assert key in d, key
    assert d["steps"] == 2 and [e["version"] for e in d["evals"]] == [0, 2]
    assert all(e["tasks"] == 8 and e["eval_failed"] == 0 for e in d["evals"])
    assert all(set(e["by_family"]) == set(FAMILIES) for e in d["evals"])  # both families scored
    assert 0.0 <= d["model_tool_call_share"] <= 1.0 and sum(d["tool_calls"].values()) > 0
    assert [r["version"] for r in d["per_step"]] == [1, 2]
    assert all(r["entropy"] is not None and r["approx_kl"] is not None for r in d["per_step"])
    for name in ("reward.png", "timeline.png", "metrics.json", "evals.jsonl"):
        assert (out / name).stat().st_size > 0, name
    m = json.loads((out / "metrics.json").read_text())
    assert_no_fault(m, out)
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "policy")  # the exported policy loads
    assert not d["warmstart"]["cached"]

    # A second demo on the same directory shows the finished one's results in one line, as a new user
    # runs it (a process of its own: a writer left open would fail at its exit), and adds no file.
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    again = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "demo", "--quick", "--out", str(out), "--seed", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )  # fmt: skip
    assert (again.returncode, again.stderr) == (0, "")
    assert again.stdout.splitlines() == [
        f"gyre demo: {out} holds a finished demo, kept as it is (--out DIR for a new one): eval "
        f"{d['eval_before']} -> {d['eval_after']}, train score {d['train_score_first']} -> "
        f"{d['train_score_last']}, model tool calls {d['model_tool_call_share']:.0%}, {d['wall_s']:.0f} s; "
        f"{out / 'demo.json'}, {out / 'reward.png'}"
    ]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
