"""Tree-packed forward and loss on real tiny transformers (random weights, CPU): the same per-token
logprobs as running each path alone, and the same gradients as path-expanded training."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gyre_traj.loss import LossConfig, TorchBatch, policy_loss, target_logprobs  # noqa: E402
from gyre_traj.pack import PackConfig, PackItem, pack  # noqa: E402
from gyre_traj.select import SelectionConfig, select  # noqa: E402
from gyre_traj.synth import SynthConfig, synth_execution  # noqa: E402
from gyre_traj.tree import ExecutionTree  # noqa: E402

SMALL = SynthConfig(
    main_calls=10,
    max_context=300,
    compactions=1,
    subagents=1,
    subagent_calls=2,
    retries=1,
    drifts=1,
    system_tokens=12,
    output_tokens=(2, 6),
    summary_tokens=8,
)


def _model(kind: str) -> object:
    torch.manual_seed(0)
    common = dict(
        vocab_size=8000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa")
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    return model.float().eval()


def _trees(seeds: tuple[int, ...]) -> list[ExecutionTree]:
    out = []
    for s in seeds:
        t = ExecutionTree(f"e{s}")
        for c in synth_execution(SynthConfig(**{**SMALL.__dict__, "seed": s}), f"e{s}"):
            t.add(c)
        out.append(t)
    return out


def _alone_logprobs(model: object, tree: ExecutionTree, leaves: object) -> dict[int, float]:
    """Reference: each selected path run alone as a plain causal sequence."""
    ref: dict[int, float] = {}
    for leaf in leaves:  # type: ignore[attr-defined]
        nodes = tree.path_nodes(leaf.end)
        ids = torch.as_tensor(tree.ids[nodes], dtype=torch.long)[None]
        with torch.no_grad():
            lps = torch.log_softmax(model(ids).logits[0].float(), -1)  # type: ignore[operator]
        for k in range(1, nodes.shape[0]):
            if tree.policy[nodes[k]]:
                ref[int(nodes[k])] = float(lps[k - 1, int(tree.ids[nodes[k]])])
    return ref


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tree_packed_logprobs_equal_each_path_alone(kind: str) -> None:
    model = _model(kind)
    (tree,) = _trees((3,))
    sel = select(tree, SelectionConfig(j_max=None))
    (batch,) = pack([PackItem(tree, sel, 1.0)], PackConfig(token_budget=100_000))
    assert batch.num_tokens < sum(int(tree.depth[lf.end]) + 1 for lf in sel.leaves)  # it did de-duplicate
    with torch.no_grad():
        got = target_logprobs(model, TorchBatch.from_packed(batch))
    ref = _alone_logprobs(model, tree, sel.leaves)
    assert batch.num_loss_tokens == len(ref)
    expected = np.array([ref[int(n)] for n in batch.target_nodes])
    np.testing.assert_allclose(got.numpy(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("mode", ["ppo", "tis"])
def test_tree_and_path_expanded_gradients_match(mode: str) -> None:
    model = _model("qwen3")
    trees = _trees((1, 2))
    items = [
        PackItem(t, select(t, SelectionConfig(j_max=3)), adv)
        for t, adv in zip(trees, (0.7, -0.4), strict=True)
    ]
    cfg = LossConfig(mode=mode)  # type: ignore[arg-type]
    grads = {}
    totals = {}
    for pmode, budget in (("tree", 100_000), ("paths", 100_000), ("tree", 600)):
        model.zero_grad()  # type: ignore[attr-defined]
        total = 0.0
        batches = pack(items, PackConfig(token_budget=budget, mode=pmode))  # type: ignore[arg-type]
        for b in batches:
            tb = TorchBatch.from_packed(b)
            # Behaviour logprobs off the current policy by a fixed amount per token (a function of the
            # token, not of the packing), so ratios differ from 1 and clipping is exercised.
            seg = np.array([int(b.executions[k][1:]) for k in b.segment[b.target_pos]], np.float32)
            shift = 0.3 * torch.sin(torch.as_tensor(b.target_nodes * 1.7 + seg * 0.5, dtype=torch.float32))
            with torch.no_grad():
                old = target_logprobs(model, tb) + shift
            tb = TorchBatch(**{**tb.__dict__, "old_logprobs": old})
            loss, _ = policy_loss(target_logprobs(model, tb), tb, cfg)
            loss.backward()
            total += float(loss.detach())
        key = f"{pmode}-{budget}-{len(batches)}"
        totals[key] = total
        grads[key] = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    keys = list(grads)
    assert int(keys[2].split("-")[2]) > 1  # the small budget really split the mini-batch
    base = grads[keys[0]]
    scale = max(float(g.abs().max()) for g in base)
    assert scale > 0
    for k in keys[1:]:
        assert abs(totals[k] - totals[keys[0]]) < 1e-5
        for g0, g1 in zip(base, grads[k], strict=True):
            torch.testing.assert_close(g1, g0, atol=1e-6 * max(1.0, scale), rtol=1e-4)


def test_ppo_clipping_and_weights() -> None:
    from gyre_traj.pack import PackedBatch

    n = 4
    b = PackedBatch(
        mode="tree",
        input_ids=np.arange(5, dtype=np.int32),
        position_ids=np.arange(5, dtype=np.int32),
        parent=np.arange(-1, 4, dtype=np.int32),
        last_desc=np.full(5, 4, np.int32),
        segment=np.zeros(5, np.int32),
        target_pos=np.arange(4, dtype=np.int32),
        target_ids=np.arange(1, 5, dtype=np.int32),
        old_logprobs=np.log(np.full(n, 0.5, np.float32)),
        advantages=np.array([1, 1, -1, -1], np.float32),
        weights=np.full(n, 0.25, np.float32),
        versions=np.zeros(n, np.int32),
        target_nodes=np.arange(1, 5),
    )
    tb = TorchBatch.from_packed(b)
    new = torch.log(torch.tensor([0.9, 0.5, 0.1, 0.5]))  # ratios 1.8, 1.0, 0.2, 1.0
    loss, m = policy_loss(new, tb, LossConfig(clip_low=0.2, clip_high=0.2))
    # A>0, r=1.8 -> clipped at 1.2; A>0, r=1 -> 1; A<0, r=0.2 -> max(-0.2, -0.8) = -0.2... PPO takes min(rA, clip(r)A)
    expected = -0.25 * (1.2 * 1 + 1.0 * 1 + min(0.2 * -1, 0.8 * -1) + 1.0 * -1)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5)
    tis, _ = policy_loss(new, tb, LossConfig(mode="tis", tis_cap=1.5))
    expected_tis = -0.25 * float(
        (torch.tensor([1.5, 1.0, 0.2, 1.0]) * torch.tensor([1, 1, -1, -1.0]) * new).sum()
    )
    assert float(tis) == pytest.approx(expected_tis, abs=1e-6)


def test_malformed_batch_is_rejected() -> None:
    from gyre_traj.pack import PackError

    (tree,) = _trees((5,))
    (b,) = pack([PackItem(tree, select(tree), 1.0)], PackConfig(token_budget=100_000))
    bad = type(b)(**{**b.__dict__, "parent": b.parent.copy()})
    bad.parent[3] = 7
    with pytest.raises(PackError, match="parent indices"):
        TorchBatch.from_packed(bad)
    with pytest.raises(ValueError, match="logprobs for"):
        policy_loss(torch.zeros(1), TorchBatch.from_packed(b))


def test_entropy_kl_and_metrics_over_micro_batches() -> None:
    from gyre_traj.loss import combine_metrics, target_logprobs_entropy

    model = _model("qwen3")
    trees = _trees((3, 4))
    items = [
        PackItem(t, select(t, SelectionConfig(j_max=2)), a) for t, a in zip(trees, (0.5, -0.5), strict=True)
    ]
    one = max(b.num_tokens for it in items for b in pack([it], PackConfig(token_budget=100_000)))
    mbs = pack(items, PackConfig(token_budget=one, mode="tree"))  # one execution per micro-batch
    assert len(mbs) >= 2
    parts = []
    for b in mbs:
        tb = TorchBatch.from_packed(b)
        lp, ent = target_logprobs_entropy(model, tb)
        torch.testing.assert_close(lp, target_logprobs(model, tb))
        # the entropy of each target's distribution, by hand from the plain logits
        backbone = model.get_decoder()  # type: ignore[attr-defined]
        from gyre_traj.loss import dense_mask

        h = backbone(
            input_ids=tb.input_ids[None], attention_mask=dense_mask(tb), position_ids=tb.position_ids[None]
        )
        p = torch.softmax(model.lm_head(h.last_hidden_state[0][tb.target_pos]).float(), -1)  # type: ignore[attr-defined]
        torch.testing.assert_close(ent, -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
        old = dataclasses.replace(tb, old_logprobs=lp.detach() + 0.1)  # every log-ratio is -0.1
        _, m = policy_loss(lp, old, None, ent)
        assert m["approx_kl"] == pytest.approx(0.005, rel=1e-4) and m["weight"] > 0
        parts.append(m)
    total = combine_metrics(parts)
    w = np.array([m["weight"] for m in parts])
    assert total["entropy"] == pytest.approx(float(np.dot(w, [m["entropy"] for m in parts]) / w.sum()))
    assert total["loss"] == pytest.approx(sum(m["loss"] for m in parts))
    assert "entropy" not in combine_metrics([{"loss": 1.0, "weight": 1.0}])


def _few_hundred_parameter_qwen3() -> object:
    """A Qwen3 of 800 parameters (vocabulary 48, width 8, one layer, tied embeddings), on the CPU."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=48,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").float().eval()
    assert sum(p.numel() for p in model.parameters()) == 800
    return model


def test_target_logprobs_and_policy_loss_take_a_packed_batch() -> None:
    """What the README says: `target_logprobs(model, packed_batch)` (a `PackedBatch` straight from
    `pack`, no conversion by hand) gives each target's logprob as its path run alone, and
    `policy_loss(logprobs, packed_batch)` takes the same batch. Token ids come from per-role bands of ten
    (system 10s, user 20s, tool 30s, output 40s) to fit the tiny vocabulary."""
    from gyre_traj.pack import PackedBatch

    model = _few_hundred_parameter_qwen3()
    tree = ExecutionTree("e")
    tree.add(_small_call("c0", [10, 11, 20], [40, 41, 42]))
    tree.add(_small_call("c1", [10, 11, 20, 40, 41, 42, 30, 31], [43, 44]))  # the agent's next turn
    tree.add(_small_call("c2", [10, 11, 20, 40, 41, 42, 32], [45]))  # a branch at the tool result
    tree.add(_small_call("c3", [10, 11, 21], [46, 47]))  # another user turn from the system prompt
    sel = select(tree, SelectionConfig(j_max=None))
    (batch,) = pack([PackItem(tree, sel, 0.5)], PackConfig(token_budget=1000))
    assert isinstance(batch, PackedBatch)
    assert batch.num_tokens < sum(int(tree.depth[lf.end]) + 1 for lf in sel.leaves)  # it shared prefixes
    with torch.no_grad():
        got = target_logprobs(model, batch)
    ref = _alone_logprobs(model, tree, sel.leaves)
    assert batch.num_loss_tokens == len(ref) == 8
    expected = np.array([ref[int(n)] for n in batch.target_nodes])
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6, rtol=0)
    loss, metrics = policy_loss(target_logprobs(model, batch), batch)
    loss.backward()
    assert metrics["tokens"] == 8 and model.model.embed_tokens.weight.grad is not None  # type: ignore[attr-defined]


def _small_call(cid: str, inp: list[int], out: list[int]) -> object:
    from gyre_traj.records import Call, Role

    return Call(
        execution_id="e",
        call_id=cid,
        agent_id="main",
        role=Role.MAIN,
        input_ids=np.asarray(inp),
        output_ids=np.asarray(out),
        output_logprobs=-0.5 * np.ones(len(out)),
        weight_version=0,
    )
