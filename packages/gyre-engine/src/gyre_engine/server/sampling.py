"""Batched next-token sampling over the rows of one decode step, one `SamplerState` per request.

The logprob reported for a token is taken from the distribution it was drawn from: logits after penalties,
logit bias, temperature and top-k/top-p/min-p truncation, renormalized. Greedy rows (temperature ~0)
report the plain log-softmax of the processed logits at temperature 1 (a point mass would say 0).

A sampled token is the argmax of those log-probabilities plus Gumbel noise (the Gumbel-max trick: a
draw from exactly that distribution). The noise is a counter-based hash of the request's seed
(`sampling_seed`, or a random one), the token's index in the sequence and the vocabulary id, computed
with integer tensor ops: no generator state. So a request's draws depend on its seed and its logits
alone, never on its batch neighbours or on which path sampled the step, and the same function runs on
the host (`sample`) and inside a captured CUDA graph (`slots.py`), where a run of several steps samples
without a read-back.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

import torch

from gyre_engine.protocol import ProtocolError, SamplingParams

GREEDY_EPS = 1e-6


@dataclass
class SamplerState:
    """Per-request sampling state: parameters, seed of the noise, tokens seen (for penalties)."""

    params: SamplingParams
    vocab_size: int
    eos_ids: frozenset[int]
    prompt_ids: list[int]
    seed: int = -1
    """The noise's seed: `sampling_seed` when given; -1 draws a random one."""
    output_counts: dict[int, int] = field(default_factory=dict)
    n_generated: int = 0

    def __post_init__(self) -> None:
        if self.seed < 0:
            self.seed = random.getrandbits(62)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_EPS or self.params.top_k == 1

    @property
    def untruncated(self) -> bool:
        """Greedy, or sampled from the whole distribution at its temperature (no top-k/p, min-p): what a
        captured decode step samples on the device."""
        p = self.params
        return self.greedy or (self.kept == self.vocab_size and p.top_p >= 1.0 and p.min_p <= 0)

    @property
    def kept(self) -> int:
        """How many tokens top-k keeps: the whole vocabulary when `top_k` is -1 (off) or at least the
        vocabulary's size (SGLang accepts any top_k >= 1; larger than the vocabulary keeps it all)."""
        k = self.params.top_k
        return self.vocab_size if k < 0 or k >= self.vocab_size else k

    @property
    def next_index(self) -> int:
        """The sequence index of the next token (the noise's counter)."""
        return len(self.prompt_ids) + self.n_generated

    @property
    def needs_row_processing(self) -> bool:
        p = self.params
        return bool(
            p.frequency_penalty
            or p.presence_penalty
            or p.repetition_penalty != 1.0
            or p.logit_bias
            or (p.min_new_tokens > self.n_generated and not p.ignore_eos)
        )

    def observe(self, token: int) -> None:
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        self.n_generated += 1


_TOKEN_KEY = re.compile(r"[0-9]{1,18}")


def _is_token_key(key: str, vocab_size: int) -> bool:
    """Whether a logit_bias key names a token: ASCII decimal digits in [0, vocab_size) (`int()` alone
    would take '٣' and fail on '²' or on more than 4300 digits)."""
    return _TOKEN_KEY.fullmatch(key) is not None and int(key) < vocab_size


def validate_params(params: SamplingParams, vocab_size: int) -> None:
    """Reject values gyre-engine cannot honour, with a message that names the key."""
    unsupported = {
        "json_schema": params.json_schema,
        "regex": params.regex,
        "ebnf": params.ebnf,
        "structural_tag": params.structural_tag,
        "choice": params.choice,
        "custom_params": params.custom_params,
        "watermark": params.watermark,
    }
    for key, value in unsupported.items():
        if value is not None:
            raise ProtocolError(
                f"sampling_params.{key} (constrained or custom decoding) is not supported by gyre-engine"
            )
    if params.beam_width not in (None, 0, 1):
        raise ProtocolError("sampling_params.beam_width > 1 is not supported by gyre-engine")
    if params.n != 1:
        raise ProtocolError("sampling_params.n must be 1 in gyre-engine (send n requests instead)")
    _check_numbers(params)
    _check_token_ids(params, vocab_size)


def _check_numbers(params: SamplingParams) -> None:
    """The numeric parameters in their ranges (and finite: NaN or infinity would sample garbage)."""
    if params.max_new_tokens is None or params.max_new_tokens < 0:
        raise ProtocolError("sampling_params.max_new_tokens must be >= 0")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        # SGLang's words (fixtures/sglang-0.5.23/error_bad_temperature.json)
        raise ProtocolError(f"temperature must be a non-negative finite number, got {params.temperature}.")
    if not 0 < params.top_p <= 1:
        raise ProtocolError("sampling_params.top_p must be in (0, 1]")
    # SGLang makes a request with temperature under GREEDY_EPS greedy by setting its top_k to 1, so then
    # any top_k is taken (0 included); otherwise top_k must be -1 (the whole vocabulary) or at least 1.
    if params.temperature >= GREEDY_EPS and (params.top_k == 0 or params.top_k < -1):
        raise ProtocolError(
            f"top_k must be -1 (disable) or at least 1, got {params.top_k}."
        )  # SGLang's words
    if not 0 <= params.min_p <= 1:
        raise ProtocolError("sampling_params.min_p must be in [0, 1]")
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise ProtocolError("sampling_params.repetition_penalty must be a finite number > 0")
    for key in ("frequency_penalty", "presence_penalty"):
        if not math.isfinite(getattr(params, key)):
            raise ProtocolError(f"sampling_params.{key} must be a finite number")


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """`stop_token_ids` and the keys of `logit_bias` name tokens of the vocabulary."""
    for tid in params.stop_token_ids or []:
        if not 0 <= tid < vocab_size:
            raise ProtocolError(
                f"sampling_params.stop_token_ids has {tid}, outside the vocabulary [0, {vocab_size})"
            )
    for key, bias in (params.logit_bias or {}).items():
        if not _is_token_key(key, vocab_size):
            raise ProtocolError(
                f"sampling_params.logit_bias key {key[:50]!r} is not a token id in [0, {vocab_size})"
            )
        if math.isnan(bias):
            raise ProtocolError(f"sampling_params.logit_bias of token {key} is not a number")


def _process_row(logits: torch.Tensor, st: SamplerState) -> None:
    """In-place penalties, logit bias and min_new_tokens on one row of logits."""
    p = st.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(st.prompt_ids) | set(st.output_counts)), dtype=torch.long, device=logits.device
        )
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and st.output_counts:
        ids = torch.tensor(list(st.output_counts), dtype=torch.long, device=logits.device)
        counts = torch.tensor(list(st.output_counts.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    if p.logit_bias:
        for key, bias in p.logit_bias.items():
            logits[int(key)] += bias
    if p.min_new_tokens > st.n_generated and not p.ignore_eos:
        stops = st.eos_ids | frozenset(p.stop_token_ids or ())
        logits[torch.tensor(sorted(stops), dtype=torch.long, device=logits.device)] = float("-inf")


_M32 = 0xFFFFFFFF
_GOLDEN_I32 = 0x9E3779B1 - (1 << 32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2^32) (products stay below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab] (float32) for rows with `seeds` [B] and token indices `index` [B]
    (int64): a pure function of (seed, index, vocabulary id)."""
    seeds, index = seeds.long(), index.long()
    key = _mix32(_mix32((seeds & _M32) ^ _mix32(index & _M32)) ^ ((seeds >> 32) & _M32))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    # ids * 0x9E3779B1 mod 2^32, written with the multiplier's int32 twin (0x9E3779B1 - 2^32): the same
    # low 32 bits, and a constant that fits the 32-bit index arithmetic torch.compile generates for
    # `arange * c` (Inductor cannot compile the unsigned constant there)
    x = _mix32(key[:, None] ^ (ids[None, :] * _GOLDEN_I32 & _M32))
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def pick(logp: torch.Tensor, sampled: torch.Tensor, seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Token per row of `logp` [B, V]: argmax where `sampled` [B] (bool) is false, a draw from the row's
    distribution (Gumbel-max) where it is true."""
    noise = gumbel_noise(seeds, index, logp.shape[-1])
    return torch.argmax(logp + noise * sampled[:, None].to(noise.dtype), dim=-1)


@dataclass(frozen=True)
class RowLogprobs:
    """What a row asked for besides its token's logprob, at one position, from the same distribution:
    its top-k (logprob, id) pairs and the logprobs of the ids it named (`token_ids_logprob`)."""

    top: list[tuple[float, int]]
    ids: list[float]


@dataclass(frozen=True)
class Sampled:
    """Result of one sampling call: per row, token, its logprob, and (when any row asked) RowLogprobs."""

    tokens: list[int]
    logprobs: list[float]
    top: list[RowLogprobs] | None


def sample(
    logits: torch.Tensor,
    states: list[SamplerState],
    top_n: list[int],
    want_ids: list[tuple[int, ...] | None] | None = None,
) -> Sampled:
    """Sample one token per row of `logits` ([B, V]); `top_n[i]` > 0 asks row i for its top logprobs,
    `want_ids[i]` for the logprobs of those token ids."""
    logits = logits.float()
    if logits.shape[-1] > states[0].vocab_size:
        logits = logits[:, : states[0].vocab_size]
    for i, st in enumerate(states):
        if st.needs_row_processing:
            _process_row(logits[i], st)
    device = logits.device
    greedy = torch.tensor([st.greedy for st in states], device=device)
    temps = torch.tensor([1.0 if st.greedy else st.params.temperature for st in states], device=device)
    scaled = logits / temps[:, None]
    if any(not st.greedy and st.kept < scaled.shape[-1] for st in states):
        ks = torch.tensor([scaled.shape[-1] if st.greedy else st.kept for st in states], device=device)
        kth = torch.sort(scaled, dim=-1, descending=True).values.gather(-1, (ks - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if any(not st.greedy and st.params.top_p < 1.0 for st in states):
        tops = torch.tensor([1.0 if st.greedy else st.params.top_p for st in states], device=device)
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (probs.cumsum(-1) - probs) > tops[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if any(not st.greedy and st.params.min_p > 0 for st in states):
        minps = torch.tensor([0.0 if st.greedy else st.params.min_p for st in states], device=device)
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(
            probs < minps[:, None] * probs.max(-1, keepdim=True).values, float("-inf")
        )
    logp = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        chosen = torch.argmax(logp, dim=-1)
    else:
        seeds = torch.tensor([st.seed for st in states], device=device)
        index = torch.tensor([st.next_index for st in states], device=device)
        chosen = pick(logp, ~greedy, seeds, index)
    chosen_lp = logp.gather(-1, chosen[:, None]).squeeze(-1)
    top = _row_logprobs(logp, top_n, want_ids or [None] * len(states))
    tokens = chosen.tolist()
    for st, tok in zip(states, tokens, strict=True):
        st.observe(tok)
    return Sampled(tokens=tokens, logprobs=chosen_lp.tolist(), top=top)


def _row_logprobs(
    logp: torch.Tensor, top_n: list[int], want_ids: list[tuple[int, ...] | None]
) -> list[RowLogprobs] | None:
    if not any(top_n) and not any(want_ids):
        return None
    top: list[list[tuple[float, int]]] = [[] for _ in top_n]
    if any(n > 0 for n in top_n):
        vals, idx = torch.topk(logp, max(top_n), dim=-1)
        vals_l, idx_l = vals.tolist(), idx.tolist()
        top = [list(zip(vals_l[i][:n], idx_l[i][:n], strict=True)) for i, n in enumerate(top_n)]
    ids = [logp[i, list(w)].tolist() if w else [] for i, w in enumerate(want_ids)]
    return [RowLogprobs(t, v) for t, v in zip(top, ids, strict=True)]
