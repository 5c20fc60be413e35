"""Policy-gradient loss over packed batches (needs the `torch` extra: `pip install 'gyre-traj[torch]'`).

`target_logprobs` runs a transformers causal LM over a `PackedBatch` as `pack` makes it (or its tensors,
a `TorchBatch`), with tree position ids and an ancestor-only mask (dense boolean for "sdpa"/"eager", a
FlexAttention `BlockMask` for "flex_attention"), and returns the log-probability of every loss target
under the current policy, computing the vocabulary projection only at the positions that predict one. `policy_loss` turns those into the token-level
PPO-clipped (or truncated-importance-sampling) loss, weighted so the batch loss is a token mean per
execution, then a mean over executions, and reports with its metrics the train-inference mismatch of the
micro-batch's newest tokens as sums (`mismatch_sums`) that a step adds up exactly (`combine_mismatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from gyre_traj.pack import PackedBatch

if TYPE_CHECKING:
    import torch

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised in the no-torch wheel check
    raise ImportError(
        "gyre_traj.loss needs PyTorch: install the extra with `pip install 'gyre-traj[torch]'`"
    ) from exc


@dataclass(frozen=True)
class LossConfig:
    mode: Literal["ppo", "tis"] = "ppo"
    """"ppo": clipped importance ratio to the behaviour policy. "tis": policy gradient weighted by the
    truncated importance ratio min(pi/mu, tis_cap), no clipping."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """PPO clip range [1 - clip_low, 1 + clip_high] (a larger clip_high is the "clip-higher" variant)."""
    tis_cap: float = 2.0
    """"tis": the cap of the importance ratio."""
    ppo_tis_cap: float = 0.0
    """"ppo": truncated importance sampling of the train-inference mismatch, as verl's TIS. 0: off (the
    clipped ratio is to the behaviour policy, as the engine recorded it). > 0: the clipped ratio is to
    the trainer's own logprob of the token (detached: the weights the gradient is taken at), and each
    token's term is weighted by min(exp(trainer - behaviour), ppo_tis_cap). With one update per
    mini-batch that ratio is 1 in value, so the gradient is that of "tis" at the same cap; `clip_frac`
    is then the share of tokens whose weight was capped."""
    temperature: float = 1.0
    """Sampling temperature of the behaviour policy: logits are divided by it so the ratio compares
    the distributions that were actually sampled from."""

    def __post_init__(self) -> None:
        if self.mode not in ("ppo", "tis"):
            raise ValueError(f"mode must be 'ppo' or 'tis', got {self.mode!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.tis_cap <= 0 or self.ppo_tis_cap < 0:
            raise ValueError(
                f"tis_cap must be > 0 and ppo_tis_cap >= 0 (0: off), got {self.tis_cap}, {self.ppo_tis_cap}"
            )


@dataclass(frozen=True)
class TorchBatch:
    """A PackedBatch's arrays as tensors on one device."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    last_desc: torch.Tensor
    target_pos: torch.Tensor
    target_ids: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    versions: torch.Tensor

    @staticmethod
    def from_packed(b: PackedBatch, device: torch.device | str = "cpu") -> TorchBatch:
        b.validate()

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

        return TorchBatch(
            input_ids=t(b.input_ids, torch.long),
            position_ids=t(b.position_ids, torch.long),
            last_desc=t(b.last_desc, torch.long),
            target_pos=t(b.target_pos, torch.long),
            target_ids=t(b.target_ids, torch.long),
            old_logprobs=t(b.old_logprobs, torch.float32),
            advantages=t(b.advantages, torch.float32),
            weights=t(b.weights, torch.float32),
            versions=t(b.versions, torch.long),
        )


def dense_mask(tb: TorchBatch) -> torch.Tensor:
    """[1, 1, T, T] boolean, True where a query may attend a key (the key is an ancestor-or-self)."""
    n = tb.input_ids.shape[0]
    idx = torch.arange(n, device=tb.input_ids.device)
    q, kv = idx[:, None], idx[None, :]
    return ((kv <= q) & (q <= tb.last_desc[None, :]))[None, None]


def flex_block_mask(tb: TorchBatch, block: int = 128) -> Any:
    """A FlexAttention BlockMask for the ancestor-only structure (use with attn "flex_attention").

    The kernel evaluates the mask on whole blocks, so indices past the last token occur: the lookup
    table is padded (with -1: never attended) to a whole number of blocks rather than read out of range.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    n = tb.input_ids.shape[0]
    padded = -(-n // block) * block + block
    last_desc = torch.full((padded,), -1, dtype=tb.last_desc.dtype, device=tb.last_desc.device)
    last_desc[:n] = tb.last_desc

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (q_idx <= last_desc[kv_idx])

    return create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=str(tb.input_ids.device), BLOCK_SIZE=block
    )


def as_torch(batch: PackedBatch | TorchBatch, device: torch.device | str) -> TorchBatch:
    """The batch as tensors on `device`: a `PackedBatch` is validated and converted, a `TorchBatch`
    moved there if it is elsewhere."""
    if isinstance(batch, PackedBatch):
        return TorchBatch.from_packed(batch, device)
    if not isinstance(batch, TorchBatch):
        raise TypeError(f"expected a PackedBatch or a TorchBatch, got {type(batch).__name__}")
    if batch.input_ids.device == torch.device(device):
        return batch
    return TorchBatch(**{k: v.to(device) for k, v in batch.__dict__.items()})


def _model_device(model: Any) -> torch.device:
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def target_logprobs(
    model: Any,
    batch: PackedBatch | TorchBatch,
    *,
    attention: Literal["dense", "flex"] = "dense",
    temperature: float = 1.0,
    chunk: int = 2048,
) -> torch.Tensor:
    """Log-probabilities [L] of the batch's loss targets under `model` (a transformers causal LM), on
    the model's device. `batch` is a `PackedBatch` as `pack` makes it (or its `TorchBatch`)."""
    return target_logprobs_entropy(model, batch, attention=attention, temperature=temperature, chunk=chunk)[0]


def target_logprobs_entropy(
    model: Any,
    batch: PackedBatch | TorchBatch,
    *,
    attention: Literal["dense", "flex"] = "dense",
    temperature: float = 1.0,
    chunk: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_logprobs` and, detached, the entropy [L] of the policy's distribution (at `temperature`)
    at each target's position: the figure that shows a policy collapsing onto a few tokens."""
    tb = as_torch(batch, _model_device(model))
    mask = dense_mask(tb) if attention == "dense" else flex_block_mask(tb)
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    out = backbone(
        input_ids=tb.input_ids[None], attention_mask=mask, position_ids=tb.position_ids[None], use_cache=False
    )
    hidden = out.last_hidden_state[0]
    head = model.get_output_embeddings()
    h = hidden.index_select(0, tb.target_pos)
    parts, ents = [], []
    for lo in range(0, h.shape[0], chunk):
        logits = head(h[lo : lo + chunk]).float()
        if temperature != 1.0:
            logits = logits / temperature
        lp = torch.log_softmax(logits, dim=-1)
        parts.append(lp.gather(1, tb.target_ids[lo : lo + chunk, None])[:, 0])
        with torch.no_grad():  # in row slices: the temporaries stay small on a 150k vocabulary
            ents += [-(sl.exp() * sl).sum(-1) for sl in lp.split(256)]
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.detach()
    return torch.cat(parts), torch.cat(ents)


def policy_loss(
    new_logprobs: torch.Tensor,
    batch: PackedBatch | TorchBatch,
    cfg: LossConfig | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted token-level policy loss and its metrics. Summing this over the micro-batches of a
    mini-batch gives the mini-batch loss (weights already include the per-execution normalization).
    `batch` is the one `new_logprobs` were computed on (a `PackedBatch` or its `TorchBatch`).

    Metrics are means over the loss tokens under the loss weights: `ratio_mean`, `clip_frac` (share
    clipped), `approx_kl` (0.5 (log pi - log mu)^2, an estimate of KL(mu || pi) to the behaviour policy)
    and, with `entropy` given, `entropy`; `weight` is the weight sum they are taken over, so the means
    of several micro-batches combine (`combine_metrics`)."""
    cfg = cfg or LossConfig()
    tb = as_torch(batch, new_logprobs.device)
    if new_logprobs.shape != tb.old_logprobs.shape:
        raise ValueError(f"{tuple(new_logprobs.shape)} logprobs for {tuple(tb.old_logprobs.shape)} targets")
    log_ratio = new_logprobs - tb.old_logprobs
    ratio = torch.exp(log_ratio)
    adv = tb.advantages
    if cfg.mode == "ppo" and cfg.ppo_tis_cap > 0:
        own = torch.exp(new_logprobs - new_logprobs.detach())  # 1 in value, the policy's gradient
        is_w = torch.clamp(ratio.detach(), max=cfg.ppo_tis_cap)
        clipped = torch.clamp(own, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        per_token = -is_w * torch.minimum(own * adv, clipped * adv)
        clip_frac = (ratio.detach() > cfg.ppo_tis_cap).float()
    elif cfg.mode == "ppo":
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        clip_frac = ((ratio * adv) > (clipped * adv)).float()
    else:
        is_w = torch.clamp(ratio.detach(), max=cfg.tis_cap)
        per_token = -is_w * adv * new_logprobs
        clip_frac = (ratio.detach() > cfg.tis_cap).float()
    loss = (per_token * tb.weights).sum()
    with torch.no_grad():
        w = tb.weights
        wsum = float(w.sum()) or 1.0
        metrics = {
            "loss": float(loss.detach()),
            "tokens": float(new_logprobs.shape[0]),
            "ratio_mean": float((ratio * w).sum()) / wsum,
            "clip_frac": float((clip_frac * w).sum()) / wsum,
            "approx_kl": float((0.5 * log_ratio.pow(2) * w).sum()) / wsum,
            "weight": float(w.sum()),
        }
        if entropy is not None:
            metrics["entropy"] = float((entropy * w).sum()) / wsum
        metrics.update(mismatch_sums(log_ratio, tb.versions))
    return loss, metrics


def mismatch_sums(log_ratio: torch.Tensor, versions: torch.Tensor) -> dict[str, float]:
    """The train-inference mismatch of one micro-batch's newest tokens, as sums that combine exactly
    (`combine_mismatch`): `log_ratio` is trainer - behaviour logprob per loss target, `versions` the weight
    version each was sampled at. Only the targets of the newest version count: on the replica computing
    at that version they are the on-policy ones (the trainer and the engine held the same weights); a
    micro-batch of older tokens only reports which version it saw."""
    if versions.numel() == 0:
        return {"mismatch_version": -1.0, "mismatch_tokens": 0.0}
    newest = versions.max()
    r = log_ratio.detach()[versions == newest].double()
    return {
        "mismatch_version": float(newest),
        "mismatch_tokens": float(r.numel()),
        "mismatch_abs_sum": float(r.abs().sum()),
        "mismatch_abs_max": float(r.abs().max()),
        "mismatch_k3_sum": float((torch.expm1(r) - r).sum()),
    }


@dataclass(frozen=True)
class Mismatch:
    """Train-inference mismatch over a step's on-policy loss tokens (those sampled at the weight version
    the step's gradient is taken at, each once, as packed): with r = trainer - behaviour logprob, the mean
    and max of |r| and the K3 estimate of KL(behaviour || trainer), the mean of exp(r) - 1 - r. Every
    token counts alike (no loss weights). `tokens` 0: no on-policy token, the figures are 0."""

    tokens: int = 0
    abs_mean: float = 0.0
    abs_max: float = 0.0
    k3: float = 0.0


def merge_mismatch_sums(parts: list[dict[str, float]], version: int | None = None) -> dict[str, float]:
    """The `mismatch_sums` of several micro-batches (or slices of one) as one: sums added and maxima taken
    over the parts whose newest version is `version` (None: the newest any part saw)."""
    have = [p for p in parts if p.get("mismatch_tokens", 0.0) > 0]
    if version is None:
        version = int(max((p["mismatch_version"] for p in have), default=-1))
    mine = [p for p in have if int(p["mismatch_version"]) == version]
    if not mine:
        return {"mismatch_version": float(version), "mismatch_tokens": 0.0}
    return {
        "mismatch_version": float(version),
        "mismatch_tokens": sum(p["mismatch_tokens"] for p in mine),
        "mismatch_abs_sum": sum(p["mismatch_abs_sum"] for p in mine),
        "mismatch_abs_max": max(p["mismatch_abs_max"] for p in mine),
        "mismatch_k3_sum": sum(p["mismatch_k3_sum"] for p in mine),
    }


def combine_mismatch(parts: list[dict[str, float]], version: int | None = None) -> Mismatch:
    """One step's `Mismatch` from its micro-batches' metrics (`mismatch_sums`, wherever each was
    computed): the sums added and the maxima taken over the parts whose newest version is `version` (the
    step's; None: the newest any part saw), never averages of averages."""
    s = merge_mismatch_sums(parts, version)
    n = s["mismatch_tokens"]
    if not n:
        return Mismatch()
    return Mismatch(
        tokens=int(n),
        abs_mean=s["mismatch_abs_sum"] / n,
        abs_max=s["mismatch_abs_max"],
        k3=s["mismatch_k3_sum"] / n,
    )


MEAN_METRICS = ("ratio_mean", "clip_frac", "approx_kl", "entropy")
"""`policy_loss` metrics that are weighted means over loss tokens."""


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One mini-batch's metrics from its micro-batches': `loss` and `tokens` summed, the weighted means
    (`MEAN_METRICS`) averaged under each micro-batch's `weight`. A mean none of them reports is left out."""
    out = {"loss": sum(p.get("loss", 0.0) for p in parts), "tokens": sum(p.get("tokens", 0.0) for p in parts)}
    for name in MEAN_METRICS:
        have = [p for p in parts if name in p and "weight" in p]
        wsum = sum(p["weight"] for p in have)
        if have and wsum > 0:
            out[name] = sum(p[name] * p["weight"] for p in have) / wsum
    return out
