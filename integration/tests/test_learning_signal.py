"""The learning signal through the real pipeline: the built-in harness runs two executions of one task
through a real gyre-proxy and gyre-engine (processes), the proxy's TITO records become gyre-traj trees,
group advantages (+0.5 / -0.5), J_max selection and tree packing, gyre-train's core applies one update,
and the engine pulls the new version over gyre-xfer.

What would break it, and where this test fails:
- a loss mask covering the tool output (or the prompt): the loss targets of each execution are exactly
  its recorded output tokens, with their behaviour logprobs;
- a logprob shifted by one position: the trainer's logprobs at the start of the step equal the
  engine's sampled ones (PPO ratio 1, KL ~0), and a plain forward of each call agrees with the records;
- a flipped advantage sign: the rewarded execution's output tokens gain log-probability, the other
  loses it (measured by a plain transformers forward of each call, not by the trainer's packing);
- a weight version that never reaches the engine: after the update the engine reports the new
  version, and its logprob of a token equals the trained model's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from gyre.procs.group import ProcessGroup, python_argv
from gyre.rollout.agents.agent import Execution, run_execution
from gyre.rollout.tasks.qa import make_task
from gyre_base.ports import free_port
from gyre_traj.io import read_records
from gyre_traj.pack import PackConfig, PackItem, pack
from gyre_traj.records import Call, Score
from gyre_traj.select import SelectionConfig, select
from gyre_traj.tree import Forest
from gyre_traj.weights import group_advantages

torch = pytest.importorskip("torch")


def _wait(url: str, what: str, procs: ProcessGroup, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} not up within {timeout_s} s")


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from gyre_engine.server.model_factory import create_model

    tmp = tmp_path_factory.mktemp("signal")
    model_dir = create_model(tmp / "model", "tiny", seed=3)
    procs = ProcessGroup(tmp / "logs")
    engine = f"http://127.0.0.1:{free_port()}"
    proxy = f"http://127.0.0.1:{free_port()}"
    records = tmp / "records.msgpack"
    try:
        procs.start(
            "engine",
            python_argv(
                "gyre_engine", "serve", "--model", str(model_dir), "--port", engine.rsplit(":", 1)[1]
            ),
            env={"OMP_NUM_THREADS": "1"},
        )
        procs.start(
            "proxy",
            python_argv(
                "gyre_proxy.cli", "serve", "--tokenizer", str(model_dir), "--engine", engine,
                "--port", proxy.rsplit(":", 1)[1], "--record-log", str(records),
            ),
        )  # fmt: skip
        _wait(f"{engine}/health", "gyre-engine", procs)
        _wait(f"{proxy}/health", "gyre-proxy", procs)
        yield {"model_dir": model_dir, "engine": engine, "proxy": proxy, "records": records}
    finally:
        procs.close()


async def _two_executions(proxy: str) -> list[Execution]:
    import random

    task = make_task(random.Random(7), "g0", family="measure")
    exs = [Execution(f"g0-e{j}", "g0", task, 0.0) for j in range(2)]
    async with httpx.AsyncClient(timeout=60.0) as http:
        for ex in exs:  # call 1, the tool's output as a user turn (scripted fallback), call 2
            await run_execution(
                http,
                proxy,
                ex,
                turns=2,
                max_tokens=10,
                temperature=1.0,
                retry_for_s=30.0,
                scripted_fallback=True,
            )
    return exs


def _output_logprob(model: Any, call: Call, full_input: np.ndarray) -> np.ndarray:
    """Log-probabilities of a call's output tokens by one plain causal forward (no packing)."""
    ids = torch.tensor(np.concatenate([full_input, call.output_ids]).tolist(), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    n, m = full_input.size, call.output_ids.size
    lp = torch.log_softmax(logits[n - 1 : n + m - 1], dim=-1)
    return lp.gather(1, torch.tensor(call.output_ids.tolist(), dtype=torch.long)[:, None])[:, 0].numpy()


def _mean_lp(model: Any, calls: list[tuple[Call, np.ndarray]]) -> float:
    return float(np.concatenate([_output_logprob(model, c, inp) for c, inp in calls]).mean())


@pytest.mark.slow
def test_one_step_moves_the_rewarded_tokens_and_the_engine_serves_it(system: dict[str, Any]) -> None:
    from gyre_engine.client import EngineClient
    from gyre_engine.protocol import SamplingParams
    from gyre_train.core import Core, CoreConfig, OptimConfig
    from gyre_train.model import build_model, load_pretrained
    from gyre_train.modelconfig import ModelConfig

    exs = asyncio.run(_two_executions(system["proxy"]))
    assert all(ex.calls == 2 for ex in exs)
    recs = [r for r in read_records(system["records"]) if isinstance(r, Call)]
    forest = Forest()
    for r in recs:
        forest.add(r)
    inputs: dict[str, np.ndarray] = {}
    calls: dict[str, list[tuple[Call, np.ndarray]]] = {ex.execution_id: [] for ex in exs}
    for r in recs:  # each call's whole input (the records are delta-encoded against the previous call)
        if r.input_ids is not None:
            full = np.asarray(r.input_ids)
        else:
            assert r.input_delta is not None
            prev = inputs[r.input_delta.parent]
            full = np.concatenate([prev[: r.input_delta.keep], r.input_delta.append])
        inputs[r.call_id] = np.concatenate([full, r.output_ids])
        calls[r.execution_id].append((r, full))
    good, bad = exs[0].execution_id, exs[1].execution_id
    scores = [
        Score(execution_id=good, group_id="g0", value=1.0),
        Score(execution_id=bad, group_id="g0", value=0.0),
    ]
    adv, _ = group_advantages(scores)
    assert adv == {good: 0.5, bad: -0.5}
    items = [
        PackItem(forest.trees[e], select(forest.trees[e], SelectionConfig(j_max=5)), adv[e])
        for e in (good, bad)
    ]
    mbs = pack(items, PackConfig(token_budget=4096, mode="tree"))

    # Loss mask: each execution's targets are exactly its recorded output tokens (no prompt, no tool output).
    for e in (good, bad):
        want = sorted(int(t) for c, _ in calls[e] for t in c.output_ids)
        want_lp = sorted(float(x) for c, _ in calls[e] for x in c.output_logprobs)
        got, got_lp = [], []
        for b in mbs:
            mine = np.asarray([b.executions[s] == e for s in b.segment[b.target_pos]])
            got += b.target_ids[mine].tolist()
            got_lp += b.old_logprobs[mine].tolist()
        assert sorted(got) == want
        np.testing.assert_allclose(sorted(got_lp), want_lp, rtol=0, atol=1e-6)

    mc = ModelConfig.from_model_dir(system["model_dir"])  # as the core cell builds its model
    model = build_model(mc)
    load_pretrained(model, mc, system["model_dir"])
    core = Core(model, mc, CoreConfig(token_budget=4096, optim=OptimConfig(lr=3e-3)))
    try:
        model.eval()
        # Positions: a plain forward of each call gives the engine's own logprobs of what it sampled.
        for e in (good, bad):
            for c, inp in calls[e]:
                np.testing.assert_allclose(_output_logprob(model, c, inp), c.output_logprobs, atol=2e-4)
        before = {e: _mean_lp(model, calls[e]) for e in (good, bad)}
        report = core.train_step(mbs)
        # The trainer's packed logprobs at the step's start equal the behaviour policy's: ratio 1, KL ~0.
        assert abs(report.metrics["ratio_mean"] - 1.0) < 1e-3 and report.metrics["approx_kl"] < 1e-6
        assert report.metrics["entropy"] > 0 and report.version == 1
        after = {e: _mean_lp(model, calls[e]) for e in (good, bad)}
        assert after[good] > before[good] + 1e-3, (before, after)
        assert after[bad] < before[bad] - 1e-3, (before, after)

        # The engine pulls the new version and serves it: its version label and its logprobs.
        first_in = calls[good][0][1]

        async def engine_side() -> Any:
            async with EngineClient(system["engine"], timeout_s=60.0) as c:
                rep = await c.update_weights_from_xfer(
                    core.publisher.address, min_version=core.snapshot, transport="shm", weight_version="1"
                )
                assert rep.success, rep.message
                return await c.generate(
                    [int(x) for x in first_in],
                    SamplingParams(max_new_tokens=1, temperature=0.0),
                    return_logprob=True,
                )

        out = asyncio.run(engine_side())
        assert out.meta_info.weight_version == "1"
        tok = out.output_ids[0]
        engine_lp = out.meta_info.output_token_logprobs[0][0]
        ids = torch.tensor(first_in.tolist(), dtype=torch.long)[None]
        with torch.no_grad():
            mine = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), -1)[tok].item()
        assert abs(engine_lp - mine) < 2e-4
    finally:
        core.close()
