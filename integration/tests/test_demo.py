"""`gyre demo --quick`: the whole path on real processes (warm start into the cache, RL on two cells under
the elastic policy, held-out evaluations, outputs). Too short to learn anything: it checks that every
output is written and consistent, not the figures (those are in the README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gyre.cli import main
from gyre.tasks import FAMILIES


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
    assert m["attempts"] == 1 and m["survival"]["events"] == []  # no fault: no new attempt, no restart
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "policy")  # the exported policy loads
    assert not d["warmstart"]["cached"]
