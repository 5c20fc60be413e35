"""Checks of the slot decode path (`server/slots.py`) and of prefills into the slots
(`server/slot_prefill.py`), shared by the CPU tests (slots without graphs, `test_slots.py`,
`test_slot_prefill.py`) and the CUDA tests (captured graphs, `test_cuda_graphs.py`,
`test_slot_prefill_cuda.py`). Each takes an in-process engine (or a way to make one) and, where it
compares, a transformers reference model on the engine's device."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gyre_engine.protocol import SamplingParams
from gyre_engine.server.engine import Engine
from gyre_engine.server.kv_transfer import export_prefix, import_prefix
from gyre_engine.server.request import EngineRequest, TokenEvent
from gyre_engine.server.weights import apply_named_tensors, read_model_dir

SYSTEM = [1000 + i for i in range(40)]
USER = [1200 + i * 7 for i in range(9)]
TOOL = [1400 + i * 3 for i in range(15)]


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()


def greedy_params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def run_all(
    engine: Engine, reqs: list[tuple[list[int], SamplingParams]], logprob: bool = False
) -> list[dict[str, Any]]:
    """Submit every request at once; per request its output ids, logprobs, cached tokens, versions."""
    outs: list[dict[str, Any]] = [
        {"ids": [], "lps": [], "cached": 0, "versions": [], "done": threading.Event()} for _ in reqs
    ]

    def sink_of(o: dict[str, Any]) -> Any:
        def sink(ev: TokenEvent) -> None:
            o["ids"].extend(ev.token_ids)
            o["lps"].extend(ev.logprobs)
            o["versions"].extend([ev.weight_version] * len(ev.token_ids))
            o["cached"] = ev.cached_tokens
            if ev.finish is not None:
                o["finish"] = ev.finish
                o["done"].set()

        return sink

    tag = threading.get_ident()
    for i, ((ids, sp), o) in enumerate(zip(reqs, outs, strict=True)):
        engine.submit(
            EngineRequest(f"s{tag}-{i}-{id(o)}", ids, sp, return_logprob=logprob), sink_of(o)
        ).result(60)
    for o in outs:
        assert o["done"].wait(300), "request did not finish"
    return outs


def reference_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=dev),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


def check_concurrent_greedy(engine: Engine, ref: Any) -> None:
    """Rows of different lengths and budgets join together and leave at different steps (slot
    compaction), each equal to transformers' generate run alone."""
    prompts = [SYSTEM + USER, USER, SYSTEM[:7] + TOOL, TOOL[:3], SYSTEM + TOOL + USER, [5, 6]]
    budgets = [24, 9, 17, 30, 12, 21]
    outs = run_all(engine, [(p, greedy_params(n)) for p, n in zip(prompts, budgets, strict=True)])
    for p, n, o in zip(prompts, budgets, outs, strict=True):
        assert o["ids"] == reference_greedy(ref, p, n)


def check_logprobs(engine: Engine, ref: Any, atol: float = 1e-4) -> None:
    """Sampled rows (temperature 0.7, seeded) and greedy rows in one batch: each token's logprob equals a
    separate forward pass (log-softmax of logits / temperature; temperature 1 for greedy rows)."""
    dev = next(ref.parameters()).device
    sampled = SamplingParams(max_new_tokens=16, temperature=0.7, sampling_seed=7, ignore_eos=True)
    reqs = [(SYSTEM + TOOL, sampled), (SYSTEM + USER, greedy_params(16))]
    for all_greedy in (False, True):
        batch = reqs if not all_greedy else [reqs[1], (TOOL, greedy_params(10))]
        outs = run_all(engine, batch, logprob=True)
        for (ids, sp), o in zip(batch, outs, strict=True):
            temp = sp.temperature if sp.temperature > 0 else 1.0
            full = torch.tensor([ids + o["ids"]], device=dev)
            with torch.no_grad():
                logits = ref(full).logits[0, len(ids) - 1 : -1].float()
            want = torch.log_softmax(logits / temp, dim=-1).gather(
                -1, torch.tensor(o["ids"], device=dev)[:, None]
            )
            assert torch.allclose(torch.tensor(o["lps"]), want.squeeze(-1).cpu(), atol=atol), (o["lps"], want)


def check_prefix_reuse_and_export(engine: Engine, other: Engine, ref: Any) -> None:
    """A call extending a finished one reuses its KV (stored from a slot row) and equals a fresh
    prefill; that prefix exported and imported into another engine continues identically."""
    engine.call(engine.flush_cache).result(30)
    first = run_all(engine, [(SYSTEM + USER, greedy_params(12))])[0]
    context = SYSTEM + USER + first["ids"] + TOOL[:5]
    rec = engine.call(export_prefix, engine, context).result(30)
    assert rec is not None and rec.token_ids == (SYSTEM + USER + first["ids"])[:-1]
    again = run_all(engine, [(context, greedy_params(12))])[0]
    assert again["cached"] == len(SYSTEM + USER) + 11
    assert again["ids"] == reference_greedy(ref, context, 12)
    other.call(other.flush_cache).result(30)
    assert other.call(import_prefix, other, rec).result(30) == len(rec.token_ids)
    moved = run_all(other, [(context, greedy_params(12))])[0]
    assert moved["cached"] == len(rec.token_ids) and moved["ids"] == again["ids"]


def check_weight_update(engine: Engine, ref: Any, new_dir: Path, old_dir: Path) -> None:
    """Weights copied in place between two steps: the decode path (graphs included) computes with the
    new weights at once, and with the old ones again after restoring them."""
    ids = SYSTEM + USER
    dev = next(ref.parameters()).device
    before = run_all(engine, [(ids, greedy_params(16))])[0]["ids"]
    assert before == reference_greedy(ref, ids, 16)
    new = read_model_dir(str(new_dir))
    engine.call(engine.update_weights, lambda: apply_named_tensors(engine.model, new), None).result(60)
    with torch.no_grad():
        apply_named_tensors(ref, {k: v.to(dev) for k, v in new.items()})
    try:
        after = run_all(engine, [(ids, greedy_params(16))])[0]["ids"]
        assert after == reference_greedy(ref, ids, 16) and after != before
    finally:
        old = read_model_dir(str(old_dir))
        engine.call(engine.update_weights, lambda: apply_named_tensors(engine.model, old), None).result(60)
        with torch.no_grad():
            apply_named_tensors(ref, {k: v.to(dev) for k, v in old.items()})
    assert run_all(engine, [(ids, greedy_params(16))])[0]["ids"] == before


def check_update_between_tokens(engine: Engine, new_dir: Path) -> None:
    """An update landing while a request decodes: every token carries one version, the versions switch
    once, and the tokens before the switch are the old weights' greedy tokens."""
    ids = SYSTEM + TOOL
    base = run_all(engine, [(ids, greedy_params(40))])[0]
    new = read_model_dir(str(new_dir))
    old_state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    update: list[Any] = []
    got: list[TokenEvent] = []
    done = threading.Event()

    def sink(ev: TokenEvent) -> None:  # on the engine thread: the update is queued before the next step
        got.append(ev)
        if sum(len(e.token_ids) for e in got) >= 5 and not update:  # events carry runs of tokens
            update.append(
                engine.call(engine.update_weights, lambda: apply_named_tensors(engine.model, new), None)
            )
        if ev.finish is not None:
            done.set()

    v0 = engine.weight_version
    engine.submit(EngineRequest("mid-update", ids, greedy_params(40)), sink).result(30)
    assert done.wait(300)
    update[0].result(60)
    versions = [ev.weight_version for ev in got for _ in ev.token_ids]
    toks = [t for ev in got for t in ev.token_ids]
    switch = versions.index(engine.weight_version)
    assert all(v == v0 for v in versions[:switch]) and all(v != v0 for v in versions[switch:])
    assert toks[:switch] == base["ids"][:switch]
    engine.call(engine.update_weights, lambda: apply_named_tensors(engine.model, old_state), None).result(60)


def run_together(engine: Engine, calls: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Submit the calls while the engine thread is held (all queued before its next step); their tokens."""
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in calls}
    done = {rid: threading.Event() for rid, _, _ in calls}

    def sink(ev: TokenEvent) -> None:
        out[ev.rid].extend(ev.token_ids)
        if ev.finish is not None:
            done[ev.rid].set()

    hold = threading.Event()
    held = engine.call(hold.wait, 30)
    try:
        queued = [engine.submit(EngineRequest(rid, ids, sp), sink) for rid, ids, sp in calls]
    finally:
        hold.set()
    assert held.result(30)
    for f in queued:
        f.result(30)
    for ev in done.values():
        assert ev.wait(300), "request did not finish"
    return out


def agent_calls(engine: Engine) -> tuple[dict[str, list[int]], dict[str, Any], dict[str, Any]]:
    """Three agents' first calls, then their next calls (each its context, its output and a tool output)
    queued together, so that they share one packed prefill; the middle one wants one token (it finishes
    at its first, and the one after it in the pass starts in its place). Returns every call's tokens and
    the engine's slot stats before and after the next calls."""
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    firsts = [[400 + 37 * a + (7 * j) % 90 for j in range(40 + 9 * a)] for a in range(3)]
    first = run_together(engine, [(f"a{a}", ids, greedy) for a, ids in enumerate(firsts)])
    before = engine.slot_stats()
    tool = [[900 + 3 * a + j for j in range(12)] for a in range(3)]
    nexts = [(f"b{a}", [*firsts[a], *first[f"a{a}"], *tool[a]], one if a == 1 else greedy) for a in range(3)]
    then = run_together(engine, nexts)
    return {**first, **then}, before, engine.slot_stats()


def slot_prefill_config(tokens: int, decode_slots: str, slot_max_len: int) -> Engine.Config:
    """The engine `check_agent_calls_with_and_without_slot_prefill` compares: four whole-width slots."""
    return Engine.Config(
        max_running_requests=4,
        decode_slots=decode_slots,
        slot_widths="full",
        slot_max_len=slot_max_len,
        prefill_graph_tokens=tokens,
    )


def check_agent_calls_with_and_without_slot_prefill(make: Callable[[int], Engine]) -> list[dict[str, Any]]:
    """`agent_calls` on an engine from `make(prefill_graph_tokens)` with slot prefills (64 tokens) and
    without (0): the same tokens for every call. Returns the two engines' (before, after) slot stats."""
    got, stats = [], []
    for tokens in (64, 0):
        engine = make(tokens)
        try:
            out, before, after = agent_calls(engine)
        finally:
            engine.shutdown()
        got.append(out)
        stats.append({"before": before, "after": after})
    assert got[0] == got[1]
    assert len(got[0]["b1"]) == 1 and len(got[0]["b2"]) == 6
    return stats
