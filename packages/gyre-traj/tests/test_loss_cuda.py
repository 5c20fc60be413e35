"""On a CUDA GPU (skipped elsewhere): the FlexAttention path (BlockMask from `last_desc`) gives the same
target logprobs as the dense mask and as each path run alone, and its backward runs. FlexAttention has no
CPU backward, and its CPU forward is not usable here, so this is the only place it is exercised."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from gyre_traj.loss import TorchBatch, policy_loss, target_logprobs  # noqa: E402
from gyre_traj.pack import PackConfig, PackItem, pack  # noqa: E402
from gyre_traj.select import SelectionConfig, select  # noqa: E402
from gyre_traj.synth import SynthConfig, synth_execution  # noqa: E402
from gyre_traj.tree import ExecutionTree  # noqa: E402


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_flex_equals_dense_and_paths_alone(dtype: str, atol: float) -> None:
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
    dense = (
        transformers.Qwen3ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
        .cuda()
        .to(getattr(torch, dtype))
        .eval()
    )
    flex = (
        transformers.Qwen3ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="flex_attention")
        .cuda()
        .to(getattr(torch, dtype))
    )
    flex.load_state_dict(dense.state_dict())
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
    tb = TorchBatch.from_packed(b, "cuda")
    with torch.no_grad():
        lp_dense = target_logprobs(dense, tb)
    lp_flex = target_logprobs(flex, tb, attention="flex")
    print(f"{dtype}: flex vs dense max |diff| {float((lp_flex.detach() - lp_dense).abs().max()):.3g}")
    torch.testing.assert_close(lp_flex.detach(), lp_dense, atol=atol, rtol=0)
    ref = np.empty(b.num_loss_tokens)
    where = {int(n): k for k, n in enumerate(b.target_nodes)}
    for leaf in sel.leaves:
        nodes = tree.path_nodes(leaf.end)
        ids = torch.as_tensor(tree.ids[nodes], dtype=torch.long, device="cuda")[None]
        with torch.no_grad():
            lps = torch.log_softmax(dense(ids).logits[0].float(), -1)
        for k in range(1, nodes.shape[0]):
            if int(nodes[k]) in where:
                ref[where[int(nodes[k])]] = float(lps[k - 1, int(tree.ids[nodes[k]])])
    print(
        f"{dtype}: dense vs each path alone max |diff| {float(np.abs(lp_dense.cpu().numpy() - ref).max()):.3g}"
    )
    np.testing.assert_allclose(lp_dense.cpu().numpy(), ref, atol=atol, rtol=0)
    loss, _ = policy_loss(lp_flex, tb)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in flex.parameters())
