"""`gyre-train mismatch MODEL_DIR`: how far the trainer's logprobs are from the engine's on one model
directory. gyre-engine loads the directory and samples continuations of a fixed prompt at temperature
1, recording each token's logprob as it serves it; the trainer builds its model from the same
directory, tree-packs the prompt and the continuations as it packs rollouts (gyre-traj records, tree,
selection, packing) and recomputes those logprobs with its training forward. Two exact implementations
of one architecture agree to float rounding; a field one side drops shows up as a large difference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gyre_train.modelconfig import Attention, ModelConfig

PROMPT = (
    "Write a function that returns the n-th Fibonacci number, then explain why its running time is "
    "linear in n and what changes if the numbers no longer fit in a machine word."
)
"""The fixed prompt (token ids from the directory's tokenizer; `fallback_prompt` without one)."""


@dataclass(frozen=True)
class MismatchConfig:
    """One measurement: the model directory, where and in which dtype both sides run, how much is sampled."""

    model_dir: str
    device: str = "cpu"
    """Both sides' device: cpu or cuda (cuda:N)."""
    dtype: str = "float32"
    """Both sides' parameter dtype: float32, bfloat16, or auto (the checkpoint's)."""
    samples: int = 4
    """Continuations of the prompt the engine samples (seeds 0..samples-1); the trainer packs them as one
    tree (the prompt once, one branch per continuation)."""
    new_tokens: int = 24
    """Tokens per continuation (end of sequence ignored)."""
    attention: Attention = "dense"
    """The trainer's attention over the packed tree: dense (4D ancestor mask) or flex (FlexAttention)."""
    decode_slots: str = "auto"
    """The engine's decode path (`gyre-engine serve --decode-slots`): auto (CUDA graphs on a GPU, batched
    lanes on the CPU), eager (the slot path without graphs), graphs or off."""
    backend: str = "transformers"
    """The trainer's backend: transformers or megatron (extra `gyre-train[megatron]`)."""


def fallback_prompt(vocab_size: int, n: int = 40) -> list[int]:
    """Fixed token ids for a directory without a tokenizer."""
    return [(7919 * i + 13) % vocab_size for i in range(1, n + 1)]


def prompt_ids(model_dir: Path, vocab_size: int) -> list[int]:
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer.model").exists():
        return fallback_prompt(vocab_size)
    from transformers import AutoTokenizer

    ids = [int(t) for t in AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]]
    return [t for t in ids if t < vocab_size] or fallback_prompt(vocab_size)


def engine_samples(cfg: MismatchConfig, prompt: list[int]) -> tuple[list[tuple[list[int], list[float]]], str]:
    """The engine's continuations of `prompt` and the logprob it recorded for each token, and its decode
    path; gyre-engine's own loader and engine thread, in this process."""
    try:
        from gyre_engine.protocol import SamplingParams
        from gyre_engine.server.engine import Engine
        from gyre_engine.server.request import EngineRequest, TokenEvent
        from gyre_engine.server.serve import ServeConfig, load_engine
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            f"gyre-train mismatch needs gyre-engine's server: pip install 'gyre-engine[server]' ({exc})"
        ) from exc
    import threading

    engine = load_engine(
        ServeConfig(
            model=str(cfg.model_dir),
            device=cfg.device,
            dtype=cfg.dtype,
            engine=Engine.Config(max_running_requests=max(cfg.samples, 1), decode_slots=cfg.decode_slots),
        )
    )
    try:
        outs: list[tuple[list[int], list[float]]] = [([], []) for _ in range(cfg.samples)]
        done = [threading.Event() for _ in range(cfg.samples)]

        def sink_of(k: int) -> Any:
            def sink(ev: TokenEvent) -> None:
                outs[k][0].extend(ev.token_ids)
                outs[k][1].extend(ev.logprobs)
                if ev.finish is not None:
                    done[k].set()

            return sink

        for k in range(cfg.samples):
            params = SamplingParams(
                max_new_tokens=cfg.new_tokens, temperature=1.0, ignore_eos=True, sampling_seed=k
            )
            engine.submit(
                EngineRequest(f"mismatch-{k}", prompt, params, return_logprob=True), sink_of(k)
            ).result(600)
        for ev in done:
            if not ev.wait(600):
                raise TimeoutError("the engine did not finish sampling within 600 s")
        st = engine.slot_stats()
        path = "lanes" if not st["enabled"] else ("slots+graphs" if st["graphs"] else "slots")
        return outs, path
    finally:
        engine.shutdown()


def packed_batch(prompt: list[int], samples: list[tuple[list[int], list[float]]]) -> Any:
    """The prompt and its continuations as one tree-packed micro-batch, through gyre-traj exactly as
    rollouts go (records -> tree -> every leaf selected -> packed), the engine's logprobs as behaviour."""
    from gyre_traj.pack import PackConfig, PackItem, pack
    from gyre_traj.records import Call, Role
    from gyre_traj.select import SelectionConfig, select
    from gyre_traj.tree import ExecutionTree

    tree = ExecutionTree("mismatch")
    for k, (ids, lps) in enumerate(samples):
        tree.add(
            Call(
                execution_id="mismatch",
                call_id=f"sample-{k}",
                agent_id="main",
                role=Role.MAIN,
                input_ids=np.asarray(prompt, dtype=np.int32),
                output_ids=np.asarray(ids, dtype=np.int32),
                output_logprobs=np.asarray(lps, dtype=np.float32),
                weight_version=0,
                t_end=float(k),
            )
        )
    sel = select(tree, SelectionConfig(j_max=None))
    total = len(prompt) + sum(len(ids) for ids, _ in samples)
    (batch,) = pack([PackItem(tree, sel, 1.0)], PackConfig(token_budget=total))
    return batch


def measure(cfg: MismatchConfig) -> dict[str, Any]:
    """Sample on the engine, recompute on the trainer; the report `gyre-train mismatch` prints."""
    import torch

    from gyre_train.model import build_model, load_pretrained, target_logprobs_of

    model_dir = Path(cfg.model_dir)
    mc = ModelConfig.from_model_dir(
        model_dir, dtype=None if cfg.dtype == "auto" else cfg.dtype, backend=cfg.backend
    )
    prompt = prompt_ids(model_dir, mc.vocab_size)
    t0 = time.perf_counter()
    samples, decode = engine_samples(cfg, prompt)
    t1 = time.perf_counter()
    batch = packed_batch(prompt, samples)
    model = build_model(mc, cfg.attention, cfg.device)
    load_pretrained(model, mc, model_dir)
    got = target_logprobs_of(model, batch, cfg.attention).detach().float().cpu().numpy()
    t2 = time.perf_counter()
    diff = np.abs(got.astype(np.float64) - batch.old_logprobs.astype(np.float64))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "model_dir": str(model_dir),
        "family": mc.family,
        "architecture": mc.architecture,
        "device": cfg.device,
        "dtype": mc.dtype,
        "backend": mc.backend,
        "attention": cfg.attention if mc.backend == "transformers" else "dense",
        "engine_decode": decode,
        "prompt_tokens": len(prompt),
        "samples": cfg.samples,
        "tokens": int(diff.shape[0]),
        "packed_tokens": batch.num_tokens,
        "max_abs_logprob_diff": float(diff.max()) if diff.size else 0.0,
        "mean_abs_logprob_diff": float(diff.mean()) if diff.size else 0.0,
        "engine_s": round(t1 - t0, 3),
        "trainer_s": round(t2 - t1, 3),
    }
