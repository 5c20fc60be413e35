"""`[cell] engine = "sglang"` end to end: each cell starts its engine through gyre-engine's SGLang launcher
and drives it only through SGLang's endpoints (a weight-update group per cell and distributed updates,
pause + memory release into training, resume + a whole-model push + continue back to rollout; the
sampler reads loads as it reads SGLang's). SGLang cannot serve on these machines (no supported GPU), so
gyre-engine stands in for it (`gyre_engine.standin`: SGLang's launch flags, gyre's own endpoints off,
so the proxy cannot hand a KV prefix over and re-prefills a moved call)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from gyre.cli import main

from .runcheck import assert_no_fault


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 7.3 minutes on this machine under load
def test_gyre_run_with_sglang_cells_against_the_standin(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "sglang.toml"
    cfg.write_text(
        f"""
[run]
policy = "elastic"
cells = 2
steps = 2
seed = 3
out_dir = "{out}"
deadline_s = 1500.0
startup_timeout_s = 900.0
[batch]
queries = 2
group_size = 2
[agent]
turns = 2
max_tokens = 8
scripted_fallback = true
timeout_s = 8.0
[cell]
engine = "sglang"
sglang_module = "gyre_engine.standin"
"""
    )
    assert main(["run", str(cfg)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps_applied"] == 2 and m["final_version"] == 2
    assert_no_fault(m, out)
    rollout = [c for c in m["final_cells"].values() if c["role"] == "rollout"]
    assert rollout and all(c["engine_version"] == "2" for c in rollout)  # read from /model_info
    logs = out / "logs"
    for i in (0, 1):  # started by the launcher's command line: SGLang's flags, into the stand-in
        said = (logs / f"cell-{i}.log").read_text(errors="replace")
        assert "-m gyre_engine.standin --model-path" in said and "--enable-memory-saver" in said
    pushed = [
        int(v)
        for i in (0, 1)
        for v in re.findall(r"SGLang at version (\d+)", (logs / f"cell-{i}.log").read_text(errors="replace"))
    ]
    assert max(pushed) == 2  # weights reached the engines by SGLang's distributed update
    assert m["switches_to_training"] >= 1  # a cell went to training and back: pause, release, resume
