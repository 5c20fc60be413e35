"""The engine serves each dense family exactly: Qwen2 (Qwen2.5), Qwen3 and Llama checkpoints with
non-default forward fields (RoPE base and scaling, RMSNorm epsilon, q/k/v and output biases, Llama's MLP
biases, a head_dim other than hidden / heads, untied embeddings), through the batched lanes and the slot
step (the CUDA path's bookkeeping, without graphs), greedy equal to transformers' generate and logprobs
equal to a separate forward. The slot step takes what its attention computes and leaves the rest to
the lanes; in Triton's interpreter, the slot kernel serves a Llama and a head_dim that is not a power of
two falls back to the reference attention."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the shared checks (tests run with --import-mode=importlib)
import slot_checks  # noqa: E402
from gyre_engine.server.engine import Engine  # noqa: E402
from gyre_engine.server.model_factory import create_model  # noqa: E402
from gyre_engine.server.serve import ServeConfig, load_engine  # noqa: E402
from gyre_engine.server.slots import SlotBatch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
FIELDS: dict[str, dict[str, Any]] = {
    "qwen2": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_scaling": YARN},
    "qwen3": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True},
    "llama": {
        "rope_theta": 5e5,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
        "head_dim": 32,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


def family_dir(out: Path, family: str, **extra: Any) -> Path:
    """A tiny checkpoint of `family` with `FIELDS[family]`, its biases and norm weights made random (an
    init leaves them at 0 and 1, where a dropped bias or norm would not show)."""
    path = create_model(
        out,
        "tiny",
        seed=3,
        family=family,
        overrides={"max_position_embeddings": 256, **FIELDS[family], **extra},
    )
    state = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(4)
    for name, t in state.items():
        if name.endswith(".bias"):
            state[name] = torch.randn(t.shape, generator=g) * 0.5
        elif "norm" in name:
            state[name] = 1 + 0.3 * torch.randn(t.shape, generator=g)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: family_dir(root / f, f) for f in FIELDS}


def _engine(d: Path, slots: str) -> Engine:
    cfg = Engine.Config(max_running_requests=8, decode_slots=slots)
    return load_engine(ServeConfig(model=str(d), device="cpu", engine=cfg))


@pytest.mark.parametrize("slots", ["eager", "off"])
@pytest.mark.parametrize("family", sorted(FIELDS))
def test_each_family_is_served_exactly(family: str, slots: str, dirs: dict[str, Path]) -> None:
    d = dirs[family]
    engine = _engine(d, slots)
    try:
        assert (engine.slots is not None) == (slots == "eager")
        assert type(engine.model).__name__ == json.loads((d / "config.json").read_text())["architectures"][0]
        ref = slot_checks.load_hf(d)
        slot_checks.check_concurrent_greedy(engine, ref)
        slot_checks.check_logprobs(engine, ref)
        if slots == "eager":
            assert engine.slot_stats()["eager_steps"] > 0
    finally:
        engine.shutdown()


def test_the_slot_step_leaves_what_it_does_not_compute_to_the_lanes() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    dims = dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )

    def why(cfg: Any) -> str | None:
        return SlotBatch.unsupported(AutoModelForCausalLM.from_config(cfg))

    assert why(LlamaConfig(**dims)) is None and why(Qwen2Config(**dims)) is None
    assert "model_type 'mistral'" in str(why(MistralConfig(**dims)))
    dynamic = LlamaConfig(**dims, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "rope_type 'dynamic'" in str(why(dynamic))
    sliding = Qwen2Config(**dims, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding" in str(why(sliding))


@pytest.mark.long  # a few minutes in Triton's CPU interpreter
def test_the_triton_slot_kernel_serves_a_llama_and_odd_head_dims_fall_back(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    from interpret import interpret

    odd = family_dir(tmp_path / "odd", "qwen2", head_dim=24)  # not a power of two: the reference attention
    out = interpret(
        f"""
        import torch, slot_checks
        from gyre_engine.server.decode_attn import triton_available
        from gyre_engine.server.engine import Engine
        from gyre_engine.server.serve import ServeConfig, load_engine
        assert triton_available(torch.device("cpu"))
        for d in ({str(dirs["llama"])!r}, {str(odd)!r}):
            cfg = Engine.Config(max_running_requests=8, decode_slots="eager")
            eng = load_engine(ServeConfig(model=d, device="cpu", engine=cfg))
            try:
                slot_checks.check_concurrent_greedy(eng, slot_checks.load_hf(d))
                assert eng.slot_stats()["eager_steps"] > 0
            finally:
                eng.shutdown()
        print("ok")
        """,
        timeout=900,
    )
    assert out.strip().endswith("ok")
