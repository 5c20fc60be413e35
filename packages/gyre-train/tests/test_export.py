"""Export: a core checkpoint becomes a Hugging Face model directory that transformers loads with the
checkpoint's exact weights and gyre-engine serves (with the tokenizer and chat template of the model
training started from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gyre_engine.server")
from gyre_engine.server.model_factory import create_model  # noqa: E402
from gyre_train.cli import main  # noqa: E402
from gyre_train.core import Core, CoreConfig  # noqa: E402
from gyre_train.export import ExportError, export_checkpoint, export_model, read_checkpoint  # noqa: E402
from gyre_train.model import ModelConfig, build_model  # noqa: E402


def _config(src: Path, tied: bool) -> ModelConfig:
    c = json.loads((src / "config.json").read_text())
    return ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], tie_word_embeddings=tied,
    )  # fmt: skip


def _trained(mc: ModelConfig, ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """A core of `mc` with weights moved off their init, checkpointed to `ckpt`; its logits for `ids`."""
    core = Core(build_model(mc), mc, CoreConfig())
    try:
        with torch.no_grad():
            for p in core.model.parameters():
                p.add_(torch.randn_like(p) * 0.01)  # weights no init reproduces
        core.save(ckpt)
        with torch.no_grad():
            return core.model(input_ids=ids).logits
    finally:
        core.close()


def test_checkpoint_exports_to_a_model_directory(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = create_model(tmp_path / "src", "tiny", seed=1)
    c = json.loads((src / "config.json").read_text())
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    want = _trained(_config(src, tied=True), tmp_path / "ckpt", ids)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--tokenizer", str(src)]) == 0
    out = tmp_path / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=1e-6)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == c["eos_token_id"] and cfg["pad_token_id"] == c["pad_token_id"]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>user"
    )
    assert json.loads((out / "gyre_export.json").read_text())["version"] == 0

    # gyre-engine serves it: its engine loads the directory and greedy-decodes with the same logits
    from gyre_engine.server.serve import ServeConfig, load_engine

    engine = load_engine(ServeConfig(model=str(out), device="cpu"))
    try:
        got = dict(engine.model.named_parameters())["model.embed_tokens.weight"]
        torch.testing.assert_close(got, model.model.embed_tokens.weight, rtol=0, atol=0)
    finally:
        engine.shutdown()


def test_export_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="not a gyre-train checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out", tmp_path)
    assert main(["export", str(tmp_path), str(tmp_path / "out"), "--tokenizer", str(tmp_path)]) == 2


def test_an_untied_model_exported_in_shards_loads_with_its_exact_weights(tmp_path: Path) -> None:
    """A model with its own lm_head, written in shards (the bound set below the model's size, as a
    model past 5 GiB is): transformers loads the index and computes the trained logits, and the files
    of an earlier single-file export in the same directory are gone."""
    from transformers import AutoModelForCausalLM

    src = create_model(tmp_path / "src", "tiny", seed=2)
    mc = _config(src, tied=False)
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    want = _trained(mc, tmp_path / "ckpt", ids)
    mc2, weights, _ = read_checkpoint(tmp_path / "ckpt")
    assert "lm_head.weight" in weights
    out = tmp_path / "out"
    export_model(mc2, weights, out, src)  # one file first
    assert (out / "model.safetensors").exists()
    biggest = max(t.numel() * t.element_size() for t in weights.values())
    export_model(mc2, weights, out, src, max_shard_bytes=biggest)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert set(index["weight_map"]) == set(weights)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=1e-6)


def test_weights_of_another_shape_are_refused_by_name(tmp_path: Path) -> None:
    src = create_model(tmp_path / "src", "tiny", seed=3)
    mc = _config(src, tied=True)
    _trained(mc, tmp_path / "ckpt", torch.tensor([[1, 2]]))
    mc2, weights, _ = read_checkpoint(tmp_path / "ckpt")
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ExportError, match=r"shapes \['model.norm.weight \(3,\)"):
        export_model(mc2, weights, tmp_path / "out", src)
    del weights["model.norm.weight"]
    with pytest.raises(ExportError, match=r"missing \['model.norm.weight'\]"):
        export_model(mc2, weights, tmp_path / "out", src)
    assert not (tmp_path / "out").exists()
