"""Diagnostics for the CUDA path (run by hand on a GPU machine): prints how far the FlexAttention and
dense-mask logprobs are from each other and from each path run alone, in float32 and bfloat16."""

from __future__ import annotations

import copy
import sys

import numpy as np
import torch
import transformers
from gyre_traj.loss import TorchBatch, policy_loss, target_logprobs
from gyre_traj.pack import PackConfig, PackItem, pack
from gyre_traj.select import SelectionConfig, select
from gyre_traj.synth import SynthConfig, synth_execution
from gyre_traj.tree import ExecutionTree


def main() -> int:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=8000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    sc = SynthConfig(
        main_calls=30,
        max_context=2000,
        compactions=1,
        subagents=2,
        subagent_calls=3,
        retries=2,
        drifts=1,
        system_tokens=64,
        output_tokens=(8, 40),
        summary_tokens=32,
    )
    tree = ExecutionTree("e")
    for c in synth_execution(sc, "e"):
        tree.add(c)
    sel = select(tree, SelectionConfig(j_max=None))
    (b,) = pack([PackItem(tree, sel, 1.0)], PackConfig(token_budget=1 << 20))
    print("tokens", b.num_tokens, "loss tokens", b.num_loss_tokens, flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        dense = (
            transformers.Qwen3ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
            .cuda()
            .to(dtype)
            .eval()
        )
        flex = (
            transformers.Qwen3ForCausalLM._from_config(
                copy.deepcopy(cfg), attn_implementation="flex_attention"
            )
            .cuda()
            .to(dtype)
        )
        flex.load_state_dict(dense.state_dict())
        tb = TorchBatch.from_packed(b, "cuda")
        with torch.no_grad():
            lp_dense = target_logprobs(dense, tb)
        try:
            lp_flex = target_logprobs(flex, tb, attention="flex")
            print(dtype, "flex vs dense max", float((lp_flex.detach() - lp_dense).abs().max()), flush=True)
            loss, _ = policy_loss(lp_flex, tb)
            loss.backward()
            print(dtype, "flex backward ok", all(p.grad is not None for p in flex.parameters()), flush=True)
        except Exception as exc:  # diagnostic: report and go on
            print(
                dtype,
                "flex failed:",
                type(exc).__name__,
                str(exc).splitlines()[0][:300] if str(exc) else "",
                flush=True,
            )
        where = {int(n): k for k, n in enumerate(b.target_nodes)}
        ref = np.zeros(b.num_loss_tokens)
        for leaf in sel.leaves:
            nodes = tree.path_nodes(leaf.end)
            ids = torch.as_tensor(tree.ids[nodes], dtype=torch.long, device="cuda")[None]
            with torch.no_grad():
                lps = torch.log_softmax(dense(ids).logits[0].float(), -1)
            for k in range(1, nodes.shape[0]):
                if int(nodes[k]) in where:
                    ref[where[int(nodes[k])]] = float(lps[k - 1, int(tree.ids[nodes[k]])])
        print(dtype, "dense vs alone max", float(np.abs(lp_dense.cpu().numpy() - ref).max()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
