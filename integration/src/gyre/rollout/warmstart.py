"""The supervised warm start of the embedded model: synthetic transcripts of the built-in tasks, rendered
exactly as gyre-proxy renders them, so the model learns to emit tool calls the proxy parses, read the
tool result and answer.

A transcript is what the built-in harness and the proxy would produce for one task of the training split:
the harness's Anthropic request bodies go through gyre-proxy's own request decoding and renderer, the
assistant outputs are the texts a perfect parser round trip gives (checked with gyre-proxy's tool-call
parser), and each later call reuses the recorded output ids exactly as the proxy does. The demonstrations
come from an imperfect teacher: the tool call is always well formed and the answer is always the tool's
result, but the call's one decision (which key or op) ignores the question: the family's default half
the time, each other choice a quarter (`teacher_choices`), so the model learns the format and not what
the questions ask for.
Training is next-token cross-entropy on the assistant outputs only, a batch of transcripts tree-packed
on their shared prefix (gyre-traj's ancestor mask and tree position ids). Deterministic from the seed;
the result is a model directory cached under `$XDG_CACHE_HOME/gyre` (else `~/.cache/gyre`), keyed by the
configuration and the code that made it, so a second run finds it at once.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gyre.rollout.agents import agent
from gyre.rollout.tasks import qa

FORMAT = 1


@dataclass(frozen=True)
class WarmStartConfig:
    shape: str = "mini"
    """gyre-engine model shape (`create_model`): mini (4 layers of width 128, 1.05M parameters) is the
    largest whose steps fit the time budget on 2 cores (small, 3.7M, costs about 4x per token); tiny
    (2 x 64, initialised for random outputs) is for plumbing tests."""
    seed: int = 0
    """Seeds the random init, the transcripts and their order."""
    steps: int = 200
    """Optimizer steps."""
    batch: int = 16
    """Transcripts per step, tree-packed on their shared prefix."""
    lr: float = 3e-3
    """AdamW peak learning rate (linear warm-up, cosine decay to 10%)."""
    warmup: int = 20
    cue_share: float = 0.0
    """Share of transcripts whose call makes the question's choice whatever it is."""
    default_share: float = 0.25
    """Share of the rest whose call makes the family's default choice (its first); the rest take one of
    the family's choices at random. With the defaults the teacher calls the default half the time and
    each other choice a quarter, so the warm-started model's greedy call is the default (which the
    questions never ask for) and a sampled call is the question's about one time in four: the room RL
    has, and the reward varies within a group."""
    max_tokens: int = 48
    """The harness's max_tokens (part of the request, so of the rendered prompt's key)."""


@dataclass(frozen=True)
class Transcript:
    ids: np.ndarray
    """The last call's input followed by its output: the whole conversation as the policy saw it."""
    targets: tuple[tuple[int, int], ...]
    """(start, end) of each call's output ids in `ids` (the tokens trained on)."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gyre"


def _code_of(path: Path) -> str:
    """A module's code without its formatting, comments and docstrings (its syntax tree)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined,index]
    return ast.dump(tree)


def code_version() -> str:
    """What the warm start's result depends on besides its config: the code of these modules (not their
    formatting or docs) and the versions of the packages that make the model, render and train."""
    h = hashlib.sha256()
    for mod in (sys.modules[__name__], qa, agent):
        h.update(_code_of(Path(str(mod.__file__))).encode())
    for dist in ("gyre-engine", "gyre-proxy", "gyre-traj", "torch", "transformers", "tokenizers"):
        h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
    h.update(f"python={platform.python_version()};format={FORMAT}".encode())
    return h.hexdigest()[:16]


def cache_key(cfg: WarmStartConfig) -> str:
    blob = json.dumps(dataclasses.asdict(cfg), sort_keys=True) + code_version()
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cached_dir(cfg: WarmStartConfig) -> Path:
    return cache_root() / "warmstart" / f"{cfg.shape}-{cache_key(cfg)}"


# ---- transcripts, rendered by gyre-proxy ------------------------------------------------------------


class TranscriptMaker:
    """Renders teacher transcripts with gyre-proxy's request decoding, renderer and parser."""

    def __init__(self, tokenizer_dir: Path, max_tokens: int) -> None:
        from gyre_proxy.core import load_tokenizer
        from gyre_proxy.render import Renderer

        self.renderer = Renderer(load_tokenizer(str(tokenizer_dir)))
        self.max_tokens = max_tokens

    def _render(self, messages: list[dict[str, Any]], ex: Any) -> Any:
        from gyre_proxy import anthropic_request
        from gyre_proxy.strip import Stripper

        body = json.dumps(agent.request_body(messages, self.max_tokens, 1.0)).encode()
        req = anthropic_request.decode(body)
        assert isinstance(req, anthropic_request.ARequest)
        anthropic_request.check(req)
        conv = anthropic_request.to_conversation(req, Stripper(()))  # the harness sends no metadata blocks
        rendered, _ = self.renderer.render(conv, ex)
        return rendered

    def _output(self, text: str) -> np.ndarray:
        return np.concatenate([self.renderer.encode(text), np.asarray([self.renderer.im_end], np.int32)])

    def make(self, task: qa.Task, choice: str) -> Transcript:
        """The transcript of a teacher that calls the task's tool with `choice`, then answers with the
        tool's result."""
        from gyre_proxy.render import ExecutionCache
        from gyre_proxy.toolparse import BlockKind, parse

        step = task.call(choice)
        args = step.arguments
        call_text = "<tool_call>\n" + json.dumps({"name": step.name, "arguments": args}) + "\n</tool_call>"
        blocks = parse(call_text)
        if [(b.kind, b.name, json.loads(b.text)) for b in blocks] != [(BlockKind.TOOL, step.name, args)]:
            raise AssertionError(f"gyre-proxy parses {call_text!r} as {blocks}")
        ex = ExecutionCache()
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        first = self._render(messages, ex)
        out1 = self._output(call_text)
        tool_id = "toolu_warm_0"
        self.renderer.record_output(ex, "warm", first.gen_prompt, out1, [tool_id], "", "")
        result, err = qa.run_tool(task, step.name, args)
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": tool_id, "name": step.name, "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": result, "is_error": err}]},
        ]  # fmt: skip
        second = self._render(messages, ex)
        in1, in2 = first.ids(), second.ids()
        n1 = in1.size
        if not np.array_equal(in2[: n1 + out1.size], np.concatenate([in1, out1])):
            raise AssertionError("the second call's input does not extend the first call's input and output")
        out2 = self._output(result)
        ids = np.concatenate([in2, out2])
        return Transcript(ids, ((n1, n1 + out1.size), (in2.size, ids.size)))


def teacher_choices(todo: list[qa.Task], cfg: WarmStartConfig) -> list[str]:
    """The teacher's decision for each task: the cued choice in `cue_share` of them, the family's default
    in `default_share` of the rest, else one of the family's choices at random."""
    rng = random.Random(f"gyre-warmstart-choice-{cfg.seed}")

    def pick(t: qa.Task) -> str:
        if rng.random() < cfg.cue_share:
            return t.choice
        return t.fam.choices[0] if rng.random() < cfg.default_share else rng.choice(t.fam.choices)

    return [pick(t) for t in todo]


def transcripts(maker: TranscriptMaker, n: int, cfg: WarmStartConfig) -> list[Transcript]:
    rng = random.Random(f"gyre-warmstart-{cfg.seed}")
    todo = [qa.make_task(rng, f"warm-{i}", "train") for i in range(n)]
    return [maker.make(t, c) for t, c in zip(todo, teacher_choices(todo, cfg), strict=True)]


def pack_shared(batch: list[Transcript]) -> dict[str, np.ndarray]:
    """One tree-packed sequence: the batch's longest common prefix once, then each transcript's rest as
    a branch (tree position ids continue from the prefix; the ancestor mask keeps branches apart)."""
    first = batch[0].ids
    p = min(t.ids.size for t in batch)
    for t in batch[1:]:
        diff = np.flatnonzero(t.ids[:p] != first[:p])
        p = int(diff[0]) if diff.size else p
    p = min(p, min(s for t in batch for s, _ in t.targets) - 1)  # each target and its predictor in a branch
    ids, pos, last, tpos, tids, tw = [first[:p]], [np.arange(p)], [], [], [], []
    calls = sum(len(t.targets) for t in batch)
    total = p + sum(t.ids.size - p for t in batch)
    last.append(np.full(p, total - 1))
    at = p
    for t in batch:
        rest = t.ids[p:]
        ids.append(rest)
        pos.append(np.arange(p, t.ids.size))
        last.append(np.full(rest.size, at + rest.size - 1))
        for s, e in t.targets:
            tpos.append(np.arange(s, e) - p + at - 1)  # the token before each target predicts it
            tids.append(t.ids[s:e])
            tw.append(np.full(e - s, 1.0 / ((e - s) * calls)))
        at += rest.size
    return {
        "input_ids": np.concatenate(ids),
        "position_ids": np.concatenate(pos),
        "last_desc": np.concatenate(last),
        "target_pos": np.concatenate(tpos),
        "target_ids": np.concatenate(tids),
        "target_weights": np.concatenate(tw),
    }


def _torch_batch(arrays: dict[str, np.ndarray]) -> Any:
    import torch
    from gyre_traj.loss import TorchBatch

    def t(name: str) -> torch.Tensor:
        return torch.as_tensor(arrays[name], dtype=torch.long)

    n = arrays["target_ids"].size
    zeros = torch.zeros(n, dtype=torch.float32)
    return TorchBatch(
        t("input_ids"), t("position_ids"), t("last_desc"), t("target_pos"), t("target_ids"),
        zeros, zeros, zeros, torch.zeros(n, dtype=torch.long),
    )  # fmt: skip


def _lr(cfg: WarmStartConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def train(cfg: WarmStartConfig, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Create the model, fine-tune it, and save it (with its tokenizer) to `out_dir`."""
    import torch
    from gyre_engine.server.model_factory import create_model
    from gyre_traj.loss import target_logprobs
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    # One thread: on cores shared with other processes, OpenMP threads that spin-wait for each other made
    # each step about 7x slower on the 2-core machine (measured); one thread also fixes the sum order.
    torch.set_num_threads(1)
    create_model(out_dir, cfg.shape, cfg.seed)
    maker = TranscriptMaker(out_dir, cfg.max_tokens)
    data = transcripts(maker, cfg.steps * cfg.batch, cfg)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    losses: list[float] = []
    bar = tqdm(range(cfg.steps), desc="warm start", unit="step", disable=not progress, file=sys.stderr)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        arrays = pack_shared(data[step * cfg.batch : (step + 1) * cfg.batch])
        tb, weights = _torch_batch(arrays), torch.as_tensor(arrays["target_weights"], dtype=torch.float32)
        loss = -(target_logprobs(model, tb) * weights).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
    bar.close()
    model.eval()
    model.save_pretrained(out_dir)
    return {
        "config": dataclasses.asdict(cfg),
        "key": cache_key(cfg),
        "code_version": code_version(),
        "train_s": round(time.perf_counter() - t0, 2),
        "loss_first": round(float(np.mean(losses[:10])), 4),
        "loss_last": round(float(np.mean(losses[-10:])), 4),
        "transcripts": len(data),
    }


def warm_start(cfg: WarmStartConfig, say: Any = print, progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """The warm-started model directory for `cfg`: from the cache, else trained now and cached."""
    final = cached_dir(cfg)
    meta_path = final / "warmstart.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        say(f"warm start: cached at {final} (trained in {meta['train_s']} s)")
        return final, {**meta, "cached": True}
    say(f"warm start: {cfg.steps} steps of {cfg.batch} transcripts, shape {cfg.shape} -> {final}")
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        meta = train(cfg, tmp, progress)
        (tmp / "warmstart.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            tmp.rename(final)
        except OSError:  # another process cached the same key first: theirs is the same model
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"warm start: done in {meta['train_s']} s (loss {meta['loss_first']} -> {meta['loss_last']})")
    return final, {**meta, "cached": False}


# ---- a quick in-process check of a warm-started model -------------------------------------------------


def _generate(model: Any, prompts: list[np.ndarray], max_new: int, eos: int, pad: int) -> list[np.ndarray]:
    """Greedy continuations (up to and including `eos`) of left-padded prompts with transformers."""
    import torch

    n = max(p.size for p in prompts)
    ids = torch.full((len(prompts), n), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - p.size :] = torch.as_tensor(p)
        mask[i, n - p.size :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
            eos_token_id=eos, pad_token_id=pad,
        )  # fmt: skip
    res = []
    for row in out[:, n:].numpy():
        stop = np.flatnonzero(row == eos)
        res.append(row[: stop[0] + 1] if stop.size else row)
    return res


def check(model_dir: Path, n: int = 32, max_tokens: int = 48) -> dict[str, Any]:
    """Greedy scores of the model on `n` held-out tasks, rendered and parsed with gyre-proxy in this
    process (transformers' generate stands in for the engine): a quick look at what the warm start
    learned. The demo measures the same through the real proxy and engine."""
    import torch
    from gyre_proxy.render import ExecutionCache
    from gyre_proxy.toolparse import BlockKind, parse
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    maker = TranscriptMaker(model_dir, max_tokens)
    r = maker.renderer
    pad = int(r.tok.token_to_id("<|endoftext|>") or r.im_end)
    todo = qa.eval_set(n)
    exs = [ExecutionCache() for _ in todo]
    msgs: list[list[dict[str, Any]]] = [[{"role": "user", "content": t.prompt}] for t in todo]
    first = [maker._render(m, ex) for m, ex in zip(msgs, exs, strict=True)]
    outs = _generate(model, [f.ids() for f in first], max_tokens, r.im_end, pad)
    called, follow = 0, []
    finals: list[str | None] = [None] * n
    calls: list[list[qa.ToolCall]] = [[] for _ in todo]
    for i, (out, f) in enumerate(zip(outs, first, strict=True)):
        text = str(r.tok.decode(out.tolist(), skip_special_tokens=False))
        blocks = parse(text)
        uses = [b for b in blocks if b.kind is BlockKind.TOOL]
        if not uses:
            finals[i] = "".join(b.text for b in blocks if b.kind is BlockKind.TEXT)
            continue
        called += 1
        tid = f"toolu_check_{i}"
        r.record_output(exs[i], f"check{i}", f.gen_prompt, out, [tid], "", "")
        args = json.loads(uses[0].text)
        result, err = qa.run_tool(todo[i], uses[0].name, args)
        calls[i] = [(uses[0].name, args)]
        msgs[i] += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": tid, "name": uses[0].name, "input": args}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": result, "is_error": err}]},
        ]  # fmt: skip
        follow.append(i)
    if follow:
        second = [maker._render(msgs[i], exs[i]) for i in follow]
        for i, out in zip(
            follow, _generate(model, [s.ids() for s in second], max_tokens, r.im_end, pad), strict=True
        ):
            blocks = parse(str(r.tok.decode(out.tolist(), skip_special_tokens=False)))
            finals[i] = "".join(b.text for b in blocks if b.kind is BlockKind.TEXT)
    scores: dict[str, list[float]] = {f: [] for f in qa.FAMILIES}
    for t, final, c in zip(todo, finals, calls, strict=True):
        s = qa.evaluate(t, t.task_id, t.task_id, final or "", False, calls=c)
        scores[t.family].append(float(s.value or 0.0))
    every = [v for vs in scores.values() for v in vs]
    return {
        "tasks": n,
        "tool_call_share": round(called / n, 3),
        "score": round(float(np.mean(every)), 3),
        "by_family": {f: round(float(np.mean(v)), 3) for f, v in scores.items() if v},
    }
