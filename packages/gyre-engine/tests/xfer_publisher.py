"""A gyre-xfer snapshot publisher in its own process, for the engine's xfer tests (run as a script, never
imported by them). It opens a Mooncake and a shared-memory publisher, prints one JSON line with both
control addresses, then follows stdin: `publish KIND DIR`, `bad-shape KIND DIR`, `missing KIND DIR`, and
`megatron KIND DIR` (the same weights in Megatron-core's layout), and `churn KIND DIR0 DIR1` (publish DIR0, replying once it is out, then
DIR1, DIR0, ... back to back until stdin closes). argv[1]: lease_s."""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
from gyre_xfer.publisher import Publisher, PublisherConfig
from gyre_xfer.transport import Config, open_transport
from safetensors.numpy import load_file


def tensors_of(model_dir: str) -> dict[str, np.ndarray]:
    from pathlib import Path

    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def to_megatron(model_dir: str, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A trainer's Megatron-core GPT names: q/k/v fused per KV group (its query heads, then its key head,
    then its value head), gate and up fused; the output layer is tied to the embedding, so absent."""
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads, groups, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    for i in range(cfg["num_hidden_layers"]):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].reshape(groups, heads // groups, dim, -1)
        k = sd[p + "self_attn.k_proj.weight"].reshape(groups, 1, dim, -1)
        v = sd[p + "self_attn.v_proj.weight"].reshape(groups, 1, dim, -1)
        out[m + "self_attention.linear_qkv.weight"] = np.concatenate([q, k, v], axis=1).reshape(
            -1, q.shape[-1]
        )
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = sd[p + "input_layernorm.weight"]
        out[m + "self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"]
        fc1 = np.concatenate([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc1.weight"] = fc1
        out[m + "mlp.linear_fc1.layer_norm_weight"] = sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
    return {k: np.ascontiguousarray(a) for k, a in out.items()}


def main() -> None:
    lease_s = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    cfg = PublisherConfig(lease_s=lease_s, publish_wait_s=30.0)
    pubs = {
        kind: Publisher(open_transport(Config(kind=kind, progress_timeout_s=2)), cfg)
        for kind in ("mooncake", "shm")
    }
    print(json.dumps({k: p.address for k, p in pubs.items()}), flush=True)
    stop = threading.Event()
    churner: threading.Thread | None = None
    for line in sys.stdin:
        cmd, kind, model_dir, *rest = line.split()
        t = tensors_of(model_dir)
        if cmd == "churn":
            both, pub = [t, tensors_of(rest[0])], pubs[kind]

            def churn(both: list[dict[str, np.ndarray]] = both, pub: Publisher = pub) -> None:
                i = 1
                while not stop.is_set():
                    pub.publish(both[i % 2])
                    i += 1

            before = pub.version
            pub.publish(both[0])  # a version is there before the reply: a pull at once finds one
            print(json.dumps({"version": before}), flush=True)
            churner = threading.Thread(target=churn, daemon=True)
            churner.start()
            continue
        name = sorted(t)[0]
        if cmd == "bad-shape":  # one tensor one row short: the engine must refuse the whole version
            t[name] = np.ascontiguousarray(t[name][:-1])
        elif cmd == "missing":
            del t[name]
        elif cmd == "megatron":
            t = to_megatron(model_dir, t)
        print(json.dumps({"version": pubs[kind].publish(t), "changed": name}), flush=True)
    stop.set()
    if churner is not None:
        churner.join(timeout=30)
    for p in pubs.values():
        tr = p.transport
        p.close()
        tr.close()


if __name__ == "__main__":
    main()
