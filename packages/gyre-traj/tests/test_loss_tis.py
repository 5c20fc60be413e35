"""`LossConfig.ppo_tis_cap`: truncated importance sampling of the train-inference mismatch on the PPO loss
(verl's TIS), checked against the formula by hand; off (0) the loss and its gradient are the plain PPO
ones, bit for bit. And the mismatch sums `policy_loss` reports, combined exactly over micro-batches."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gyre_traj.loss import (  # noqa: E402
    LossConfig,
    TorchBatch,
    combine_mismatch,
    merge_mismatch_sums,
    policy_loss,
)
from gyre_traj.pack import PackedBatch  # noqa: E402

N = 6
OLD = np.log(np.array([0.5, 0.5, 0.5, 0.5, 0.2, 0.9], np.float32))
NEW = torch.log(torch.tensor([0.9, 0.5, 0.1, 0.65, 0.6, 0.3]))  # trainer/behaviour 1.8, 1, 0.2, 1.3, 3, 1/3
ADV = np.array([1, 1, -1, -1, 2, -2], np.float32)
W = np.array([0.25, 0.25, 0.25, 0.25, 0.5, 0.5], np.float32)


def _batch(versions: np.ndarray | None = None) -> TorchBatch:
    b = PackedBatch(
        mode="tree",
        input_ids=np.arange(N + 1, dtype=np.int32),
        position_ids=np.arange(N + 1, dtype=np.int32),
        parent=np.arange(-1, N, dtype=np.int32),
        last_desc=np.full(N + 1, N, np.int32),
        segment=np.zeros(N + 1, np.int32),
        target_pos=np.arange(N, dtype=np.int32),
        target_ids=np.arange(1, N + 1, dtype=np.int32),
        old_logprobs=OLD,
        advantages=ADV,
        weights=W,
        versions=np.zeros(N, np.int32) if versions is None else versions,
        target_nodes=np.arange(1, N + 1),
    )
    return TorchBatch.from_packed(b)


def _loss_and_grad(cfg: LossConfig) -> tuple[float, np.ndarray, dict[str, float]]:
    new = NEW.clone().requires_grad_()
    loss, m = policy_loss(new, _batch(), cfg)
    loss.backward()
    assert new.grad is not None
    return float(loss.detach()), new.grad.numpy().copy(), m


def test_tis_weights_each_token_by_the_capped_trainer_over_behaviour_ratio() -> None:
    cap = 1.5
    loss, grad, m = _loss_and_grad(LossConfig(ppo_tis_cap=cap))
    ratio = np.exp(NEW.numpy() - OLD)
    w_is = np.minimum(ratio, cap)  # 1.5, 1, 0.2, 1.3, 1.5, 1/3
    # the clipped ratio is to the trainer's own (detached) logprob: 1 in value, never clipped
    assert loss == pytest.approx(float(-(W * w_is * ADV).sum()), abs=1e-6)
    np.testing.assert_allclose(grad, -W * w_is * ADV, rtol=1e-6)  # d loss / d logprob per token
    assert m["clip_frac"] == pytest.approx(float((W * (ratio > cap)).sum() / W.sum()))
    plain_loss, plain_grad, _ = _loss_and_grad(LossConfig())
    assert loss != pytest.approx(plain_loss) and not np.allclose(grad, plain_grad)
    # one update per mini-batch: the same gradient as the "tis" loss at that cap
    _, tis_grad, _ = _loss_and_grad(LossConfig(mode="tis", tis_cap=cap))
    np.testing.assert_allclose(grad, tis_grad, rtol=1e-6)


def test_tis_off_is_the_plain_ppo_loss_bit_for_bit() -> None:
    loss, grad, _ = _loss_and_grad(LossConfig(ppo_tis_cap=0.0))
    ratio = torch.exp(NEW - torch.as_tensor(OLD))
    clipped = torch.clamp(ratio, 0.8, 1.2)
    adv = torch.as_tensor(ADV)
    expected = (-torch.minimum(ratio * adv, clipped * adv) * torch.as_tensor(W)).sum()
    assert loss == float(expected)
    r = ratio.numpy()
    unclipped = (r * ADV) <= (np.clip(r, 0.8, 1.2) * ADV)  # where min takes r A, the gradient is r A
    np.testing.assert_allclose(grad, np.where(unclipped, -W * r * ADV, 0.0), rtol=1e-6)
    with pytest.raises(ValueError, match="ppo_tis_cap >= 0"):
        LossConfig(ppo_tis_cap=-1.0)


def test_mismatch_sums_count_the_newest_version_and_combine_exactly() -> None:
    versions = np.array([3, 3, 2, 3, 2, 3], np.int32)
    _, m = policy_loss(NEW, _batch(versions), LossConfig())
    r = (NEW.numpy() - OLD).astype(np.float64)[versions == 3]
    assert m["mismatch_version"] == 3 and m["mismatch_tokens"] == 4
    assert m["mismatch_abs_sum"] == pytest.approx(np.abs(r).sum(), rel=1e-6)
    assert m["mismatch_abs_max"] == pytest.approx(np.abs(r).max(), rel=1e-6)
    assert m["mismatch_k3_sum"] == pytest.approx((np.exp(r) - 1 - r).sum(), rel=1e-6)
    _, old = policy_loss(NEW, _batch(np.full(N, 2, np.int32)), LossConfig())
    # a micro-batch of version-2 tokens does not count for a step at version 3, nor averages of averages
    step = combine_mismatch([m, old, m], version=3)
    assert step.tokens == 8
    assert step.abs_mean == pytest.approx(np.abs(r).mean(), rel=1e-6)
    assert step.k3 == pytest.approx((np.exp(r) - 1 - r).mean(), rel=1e-6)
    assert combine_mismatch([old], version=3).tokens == 0
    assert merge_mismatch_sums([m, old])["mismatch_tokens"] == 4  # newest version seen: 3
