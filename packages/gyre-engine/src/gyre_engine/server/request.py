"""A request inside the engine: what was asked, what was generated, and when it is finished.

`EngineRequest` is the frozen input; `Running` is the engine thread's mutable record of it, and
`TokenEvent` is what the engine hands back after each step (new tokens, their logprobs, finish reason).
Finish rules follow SGLang's order: length first, then EOS / stop token ids, then stop strings.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gyre_engine.protocol import FinishReason, ProtocolError, SamplingParams
from gyre_engine.server.prefix_cache import PrefixHit
from gyre_engine.server.sampling import RowLogprobs, SamplerState


@dataclass(frozen=True)
class EngineRequest:
    """One generation request as the engine takes it (token ids in, sampling parameters checked)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    token_ids_logprob: tuple[int, ...] | None = None
    """With `return_logprob`: at each output position, the logprobs of these ids (SGLang's feature)."""

    def __post_init__(self) -> None:
        if self.params.max_new_tokens is None:
            raise ProtocolError("max_new_tokens must be a number here (parse.py bounds null by the context)")

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens or 0

    @property
    def wants_row_logprobs(self) -> bool:
        """Top or token-id logprobs: the host head computes them (no device-side runs)."""
        return bool(self.top_logprobs_num or self.token_ids_logprob)


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request; `finish` is set on the last event of a request."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    top: list[RowLogprobs] | None
    """Per new token, when the request asked for top or token-id logprobs."""
    finish: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: str


Sink = Callable[[TokenEvent], None]


@dataclass
class Running:
    """The engine thread's record of a request (never touched by other threads)."""

    req: EngineRequest
    sink: Sink
    sampler: SamplerState
    context_len: int
    stop_strs: list[str]
    decode: Callable[[list[int]], str]
    stop_regex: list[re.Pattern[str]] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    cached_tokens: int = -1
    started: float = field(default_factory=time.monotonic)
    _context_ids: np.ndarray | None = field(default=None, repr=False)
    hit: PrefixHit | None = field(default=None, repr=False)
    """The prefix cache's answer for this request's context while it waits, ..."""
    hit_version: int = -1
    """... and the cache's version it was found at: a later step at the same version reuses it."""

    def context_length(self) -> int:
        return len(self.req.input_ids) + len(self.output)

    def context_array(self) -> np.ndarray:
        """The context as int64 ids (what a prefix lookup compares), kept while the output does not grow:
        a request waiting for admission is looked up again every step."""
        n = self.context_length()
        if self._context_ids is None or len(self._context_ids) != n:
            self._context_ids = np.asarray(self.context(), dtype=np.int64)
        return self._context_ids

    @property
    def rid(self) -> str:
        return self.req.rid

    def context(self) -> list[int]:
        return self.req.input_ids + self.output

    def finish_reason(self, token: int) -> FinishReason | None:
        """The reason to stop after `token` was appended to `output`, or None to go on."""
        p = self.req.params
        if len(self.output) >= self.req.max_new_tokens:
            return FinishReason(type="length", length=self.req.max_new_tokens)
        if len(self.req.input_ids) + len(self.output) >= self.context_len:
            return FinishReason(type="length", length=len(self.output))
        if len(self.output) >= p.min_new_tokens:
            if not p.ignore_eos and token in self.sampler.eos_ids:
                return FinishReason(type="stop", matched=token)
            if token in (p.stop_token_ids or ()):
                return FinishReason(type="stop", matched=token)
            if self.stop_strs:
                window = max(len(s) for s in self.stop_strs) + 8
                tail = self.decode(self.output[-window:])
                for s in self.stop_strs:
                    if s in tail:
                        return FinishReason(type="stop", matched=s)
            if self.stop_regex:
                tail = self.decode(self.output[-REGEX_WINDOW:])
                for pat in self.stop_regex:
                    m = pat.search(tail)
                    if m is not None and m.group(0):
                        return FinishReason(type="stop", matched=m.group(0))
        return None


def abort_reason(message: str, status_code: int = 200, err_type: str = "abort") -> FinishReason:
    return FinishReason(type="abort", message=message, status_code=status_code, err_type=err_type)


REGEX_WINDOW = 64  # tokens of output searched by stop_regex


def compile_stop_regex(stop_regex: Any) -> list[re.Pattern[str]]:
    """Compile `stop_regex` (a pattern or a list of them); ProtocolError on a bad pattern."""
    pats = [] if stop_regex is None else [stop_regex] if isinstance(stop_regex, str) else list(stop_regex)
    try:
        return [re.compile(p) for p in pats if p]
    except re.error as exc:
        raise ProtocolError(f"sampling_params.stop_regex is not a valid regular expression: {exc}") from exc


def as_stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]
