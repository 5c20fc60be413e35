"""An engine's weight update through gyre-xfer: a Megatron-layout snapshot converted on the way into a
real transformers model (tiny Qwen3 on the CPU) gives the publisher's exact weights and logits; a bad
snapshot leaves the model untouched."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from gyre_xfer.convert import megatron_to_hf, split_qkv
from gyre_xfer.errors import ShapeMismatchError
from gyre_xfer.loader import WeightLoader
from gyre_xfer.publisher import Publisher
from gyre_xfer.subscriber import SubscriberConfig
from gyre_xfer.transport import Config, Transport, open_transport

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def test_split_qkv_follows_megatrons_grouped_layout() -> None:
    # 2 groups of 2 query heads, head_dim 1, hidden 1: rows are q0 q1 k0 v0 | q2 q3 k1 v1
    fused = np.array([[10], [11], [20], [30], [12], [13], [21], [31]], np.float32)
    q, k, v = split_qkv(fused, num_heads=4, num_kv_heads=2, head_dim=1)
    assert q.ravel().tolist() == [10, 11, 12, 13]
    assert k.ravel().tolist() == [20, 21]
    assert v.ravel().tolist() == [30, 31]
    with pytest.raises(ShapeMismatchError, match="need 8"):
        split_qkv(fused[:7], 4, 2, 1)


def tiny_qwen3(seed: int) -> object:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tie_word_embeddings=False,
    )
    return transformers.Qwen3ForCausalLM(cfg).eval().to(torch.bfloat16)


def to_megatron(sd: dict[str, object]) -> dict[str, object]:
    """The trainer's side, written independently of convert.py: fuse q/k/v per KV group, gate+up."""
    out = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
        "output_layer.weight": sd["lm_head.weight"],
    }
    for i in range(2):
        p = f"model.layers.{i}."
        m = f"decoder.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].reshape(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, -1)  # type: ignore[attr-defined]
        k = sd[p + "self_attn.k_proj.weight"].reshape(KV_HEADS, 1, HEAD_DIM, -1)  # type: ignore[attr-defined]
        v = sd[p + "self_attn.v_proj.weight"].reshape(KV_HEADS, 1, HEAD_DIM, -1)  # type: ignore[attr-defined]
        out[m + "self_attention.linear_qkv.weight"] = (
            torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1]).contiguous()
        )
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = sd[p + "input_layernorm.weight"]
        out[m + "self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )  # type: ignore[list-item]
        out[m + "mlp.linear_fc1.layer_norm_weight"] = sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


@pytest.fixture(params=[pytest.param("mooncake", marks=pytest.mark.mooncake), "shm"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, Transport]]:
    a = open_transport(Config(kind=str(request.param)))
    b = open_transport(Config(kind=str(request.param)))
    yield a, b
    a.close()
    b.close()


def test_megatron_snapshot_loads_into_a_transformers_model(pair: tuple[Transport, Transport]) -> None:
    trainer, engine = tiny_qwen3(1), tiny_qwen3(2)
    trainer_sd = {k: v.contiguous() for k, v in trainer.state_dict().items()}  # type: ignore[attr-defined]
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        want = trainer(ids).logits  # type: ignore[operator]
        before = engine(ids).logits  # type: ignore[operator]
    assert not torch.equal(want, before)
    pub = Publisher(pair[0])
    try:
        pub.publish(to_megatron(trainer_sd))
        params = dict(engine.named_parameters())  # type: ignore[attr-defined]
        loader = WeightLoader(
            pair[1], SubscriberConfig(pub.address), params, convert=megatron_to_hf(HEADS, KV_HEADS, HEAD_DIM)
        )
        res = loader.load()
        assert res.version == 1 and loader.version == 1
        for name, p in params.items():
            assert torch.equal(p, trainer_sd[name]), name
        with torch.no_grad():
            got = engine(ids).logits  # type: ignore[operator]
        assert torch.equal(got, want)
        loader.close()
    finally:
        pub.close()


def test_a_snapshot_that_does_not_fit_leaves_the_model_untouched(pair: tuple[Transport, Transport]) -> None:
    engine = tiny_qwen3(2)
    params = dict(engine.named_parameters())  # type: ignore[attr-defined]
    saved = {k: v.detach().clone() for k, v in params.items()}
    sd = {k: v.detach().clone() + 1 for k, v in params.items()}
    pub = Publisher(pair[0])
    try:
        bad = dict(sd)
        del bad["lm_head.weight"]
        pub.publish(bad)
        loader = WeightLoader(pair[1], SubscriberConfig(pub.address), params)
        with pytest.raises(ShapeMismatchError, match=r"missing \['lm_head.weight'\]"):
            loader.load()
        bad = dict(sd)
        bad["model.norm.weight"] = torch.zeros(63, dtype=torch.bfloat16)
        pub.publish(bad)
        with pytest.raises(ShapeMismatchError, match=r"'model.norm.weight': snapshot has uint16\[63\]"):
            loader.load()
        for k, v in params.items():
            assert torch.equal(v, saved[k]), k
        pub.publish(sd)
        loader.load(min_version=3, direct=True)  # straight into the parameters
        assert all(torch.equal(v, sd[k]) for k, v in params.items())
        loader.close()
    finally:
        pub.close()
