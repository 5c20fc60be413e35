"""`ModelConfig`: a model directory's whole HF config, checked when read (what gyre-train does not build
exactly is refused, naming the field), carried whole through JSON (`Welcome`, checkpoints; the format of
earlier releases still reads), the embedded default unchanged, and the Megatron-core backend's refusals."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from gyre_train.modelconfig import Architecture, ModelConfig, ModelConfigError, Scratch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))  # shared helpers (tests run with --import-mode=importlib)

QWEN25 = {  # a Qwen2.5-Instruct config.json as published (dimensions shrunk), rope_theta and all
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 1000,
}
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 1000,
}


def _dir(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_directory_config_is_read_whole(tmp_path: Path) -> None:
    mc = ModelConfig.from_model_dir(_dir(tmp_path, QWEN25))
    assert mc.family == "qwen2" and mc.architecture == "Qwen2ForCausalLM" and mc.dtype == "bfloat16"
    assert mc.arch.to_dict() == QWEN25  # the whole dict, as written
    assert mc.arch.rope_theta == 1e6 and mc.arch.rms_norm_eps == 1e-6 and mc.tie_word_embeddings
    assert mc.arch.qkv_bias and not mc.arch.o_bias and not mc.arch.qk_norm and mc.head_dim == 16
    hf = mc.hf_config("dense")
    assert type(hf).__name__ == "Qwen2Config" and hf._attn_implementation == "sdpa"
    mc = ModelConfig.from_model_dir(_dir(tmp_path, LLAMA31), dtype="float32", seed=3)
    assert mc.dtype == "float32" and mc.seed == 3 and mc.family == "llama"
    assert mc.arch.rope == {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}
    assert mc.arch.rms_norm_eps == 1e-5 and not mc.tie_word_embeddings


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "qwen3_moe"}, 'model_type = "qwen3_moe"'),
        ({"model_type": "qwen2_5_vl"}, 'model_type = "qwen2_5_vl"'),
        ({"model_type": "mistral"}, 'model_type = "mistral"'),
        ({"model_type": None}, "model_type = null"),
        ({"architectures": ["Qwen2ForSequenceClassification"]}, "architectures = "),
        ({"vision_config": {"depth": 2}}, "vision_config"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, 'quantization_config = "awq"'),
        ({"use_sliding_window": True}, "use_sliding_window = true"),
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 'rope_scaling.rope_type = "dynamic"'),
        (
            {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}},
            "longrope",
        ),
        ({"hidden_act": "no_such_activation"}, 'hidden_act = "no_such_activation"'),
        ({"num_key_value_heads": 3}, "num_key_value_heads = 3"),
    ],
)
def test_what_is_not_built_exactly_is_refused_naming_the_field(
    tmp_path: Path, change: dict[str, Any], field: str
) -> None:
    d = _dir(tmp_path, {**QWEN25, **change})
    with pytest.raises(ModelConfigError, match=r"config\.json: ") as e:
        ModelConfig.from_model_dir(d)
    assert field in str(e.value)


def test_unreadable_configs_and_dtypes_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json: cannot read it"):
        ModelConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ModelConfigError, match="not JSON"):
        ModelConfig.from_model_dir(tmp_path)
    d = _dir(tmp_path, {**QWEN25, "torch_dtype": "float16"})
    with pytest.raises(ModelConfigError, match=r"weights are float16.*pass dtype"):
        ModelConfig.from_model_dir(d)
    assert ModelConfig.from_model_dir(d, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ModelConfigError, match="dtype 'float16'"):
        ModelConfig.from_model_dir(d, dtype="float16")
    with pytest.raises(TypeError):
        ModelConfig(hidden_sise=32)  # a Scratch field misspelled
    with pytest.raises(TypeError, match="unknown fields"):
        ModelConfig(Architecture(QWEN25), hidden_sise=32)


def test_json_round_trips_whole_and_reads_the_earlier_format(tmp_path: Path) -> None:
    mc = ModelConfig.from_model_dir(_dir(tmp_path, LLAMA31), seed=5)
    back = ModelConfig.from_json(mc.to_json())
    assert back == mc and back.arch.to_dict() == LLAMA31 and hash(back) == hash(mc)
    assert json.loads(mc.to_json())["format"] == 2
    # format 1: the flat from-scratch fields an earlier release wrote into Welcome and state.json
    old = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "max_position_embeddings": 1 << 20, "tie_word_embeddings": True, "seed": 2,
           "dtype": "float32", "backend": "transformers"}  # fmt: skip
    got = ModelConfig.from_dict(old)
    assert got == ModelConfig(**old) and got.family == "qwen3" and got.vocab_size == 300 and got.seed == 2
    with pytest.raises(ModelConfigError, match="format 3"):
        ModelConfig.from_dict({"format": 3, "hf": QWEN25})
    with pytest.raises(ModelConfigError, match="unknown fields"):
        ModelConfig.from_dict({**old, "rope": 1})
    with pytest.raises(ModelConfigError, match="model_type"):
        ModelConfig.from_json(json.dumps({"format": 2, "hf": {**QWEN25, "model_type": "gpt2"}}))


def test_the_embedded_default_states_every_field_its_forward_reads() -> None:
    mc = ModelConfig()
    hf = mc.arch.to_dict()
    assert hf == Scratch().hf() and hf["model_type"] == "qwen3" and mc.vocab_size == 8192
    assert hf["rope_theta"] == 10000.0 and hf["rms_norm_eps"] == 1e-6 and hf["attention_bias"] is False
    small = ModelConfig(hidden_size=32, num_attention_heads=2, head_dim=16, seed=1)
    assert small.hidden_size == 32 and small.arch.rope_theta == 10000.0 and small.seed == 1
    # dataclasses.replace changes fields of any architecture's dict, checked again
    wide = dataclasses.replace(ModelConfig(QWEN25), hidden_size=128, rope_theta=5e5)
    assert wide.hidden_size == 128 and wide.arch.rope_theta == 5e5 and wide.family == "qwen2"
    assert wide.arch.to_dict() == {**QWEN25, "hidden_size": 128, "rope_theta": 5e5}
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        dataclasses.replace(ModelConfig(QWEN25), num_key_value_heads=3)


@settings(max_examples=25, deadline=None)
@given(
    family=st.sampled_from(["qwen2", "qwen3", "llama"]),
    theta=st.floats(100.0, 1e7),
    eps=st.floats(1e-8, 1e-3),
    tie=st.booleans(),
    scaling=st.sampled_from([None, "linear", "yarn"]),
)
def test_every_field_survives_json(
    family: str, theta: float, eps: float, tie: bool, scaling: str | None
) -> None:
    cfg = {
        **QWEN25,
        "model_type": family,
        "rope_theta": theta,
        "rms_norm_eps": eps,
        "tie_word_embeddings": tie,
    }
    cfg["architectures"] = [
        {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[family]
    ]
    if scaling is not None:
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": 2.0, "original_max_position_embeddings": 1024}
    mc = ModelConfig(cfg)
    back = ModelConfig.from_json(mc.to_json())
    assert back.arch.to_dict() == cfg
    a, b = mc.hf_config(), back.hf_config()
    assert a.to_dict() == b.to_dict()
    assert back.arch.rope_theta == theta and back.arch.rms_norm_eps == eps and back.tie_word_embeddings == tie


def test_megatron_refuses_what_it_does_not_build_naming_the_field() -> None:
    assert ModelConfig(QWEN25, backend="megatron").arch.qkv_bias  # Qwen2's q/k/v biases: built
    with pytest.raises(ModelConfigError, match=r"rope_scaling\.rope_type = 'llama3'"):
        ModelConfig(LLAMA31, backend="megatron")
    plain = {**LLAMA31, "rope_scaling": None}
    assert ModelConfig(plain, backend="megatron").family == "llama"
    with pytest.raises(ModelConfigError, match="attention_bias = true"):
        ModelConfig({**plain, "attention_bias": True}, backend="megatron")
    with pytest.raises(ModelConfigError, match="mlp_bias = true"):
        ModelConfig({**plain, "mlp_bias": True}, backend="megatron")
    with pytest.raises(ModelConfigError, match="hidden_act = 'gelu'"):
        ModelConfig({**plain, "hidden_act": "gelu"}, backend="megatron")
    with pytest.raises(ModelConfigError, match="unknown backend"):
        ModelConfig(plain, backend="jax")
