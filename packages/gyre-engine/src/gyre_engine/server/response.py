"""Accumulates a request's token events into SGLang's /generate response (or a cumulative stream chunk).

Text is decoded from all output ids each time (so multi-byte characters split over tokens come out
whole); a matched stop string is cut from the text unless `no_stop_trim`. `output_ids` keep every sampled
token, the stop token included, because the trainer must see exactly what was sampled. As in SGLang, `e2e_latency` and
`weight_versions` (which weights sampled which output tokens) come only with the finished response.
"""

from __future__ import annotations

import time
from typing import Any

from gyre_engine.protocol import (
    FinishReason,
    GenerateResponse,
    LogprobEntry,
    MetaInfo,
    RowEntry,
    WeightVersionSpan,
)
from gyre_engine.server.request import EngineRequest, TokenEvent, as_stop_list
from gyre_engine.server.sampling import RowLogprobs


class ResponseBuilder:
    """Folds TokenEvents of one request into a GenerateResponse."""

    def __init__(self, req: EngineRequest, tokenizer: Any) -> None:
        self.req = req
        self.tok = tokenizer
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[RowLogprobs] = []
        self.finish: FinishReason | None = None
        self.prompt_tokens = len(req.input_ids)
        self.cached_tokens = 0
        self.weight_version = "0"
        self.spans: list[WeightVersionSpan] = []
        self.sent = 0  # output tokens already sent in a streamed chunk
        self.started = time.monotonic()

    def add(self, ev: TokenEvent) -> None:
        if ev.token_ids:
            self._span(ev.weight_version, len(ev.token_ids))
        self.output_ids.extend(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        if ev.top is not None:
            self.top.extend(ev.top)
        self.finish = ev.finish
        self.cached_tokens = ev.cached_tokens
        self.weight_version = ev.weight_version

    def chunk_due(self) -> bool:
        """Whether a stream sends a chunk now, by SGLang's rule (`SchedulerOutputStreamer`): always the
        finished one; otherwise every token at `stream_interval` 1 (the default), else the first token at
        once and then whenever `stream_interval` tokens are unsent; never while the output's tail could
        be the start of a stop string (that text may yet be cut)."""
        if self.finish is None:
            unsent = len(self.output_ids) - self.sent
            interval = self.req.params.stream_interval or 1
            if not (interval == 1 or unsent >= interval or (self.sent == 0 and unsent > 0)):
                return False
            if self._may_start_stop():
                return False
        self.sent = len(self.output_ids)
        return True

    def _may_start_stop(self) -> bool:
        stops = as_stop_list(self.req.params.stop)
        if not stops or not self.output_ids:
            return False
        tail = str(self.tok.decode(self.output_ids[-(max(len(s) for s in stops) + 1) :]))
        return any(s in tail or any(tail.endswith(s[:i]) for i in range(1, len(s) + 1)) for s in stops)

    def _span(self, version: str, n: int) -> None:
        """Output tokens [start, end) came from weights `version` (SGLang's `weight_versions`)."""
        end = len(self.output_ids) + n
        last = self.spans[-1] if self.spans else None
        if last is not None and last.version == version:
            self.spans[-1] = WeightVersionSpan(version, last.start, end)
        else:
            self.spans.append(WeightVersionSpan(version, len(self.output_ids), end))

    def _text(self) -> str:
        text = str(self.tok.decode(self.output_ids, skip_special_tokens=self.req.params.skip_special_tokens))
        f = self.finish
        if (
            f is not None
            and f.type == "stop"
            and isinstance(f.matched, str)
            and not self.req.params.no_stop_trim
        ):
            at = text.find(f.matched)
            if at >= 0:
                text = text[:at]
        return text

    def _piece(self, tid: int) -> str | None:
        return str(self.tok.decode([tid])) if self.req.return_text_in_logprobs else None

    def response(self) -> GenerateResponse:
        """The response so far, shaped as SGLang's: `e2e_latency` only once the request has finished."""
        lps: list[LogprobEntry] | None = None
        tops: list[list[RowEntry] | None] | None = None
        ids: list[list[RowEntry] | None] | None = None
        if self.req.return_logprob:
            lps = [(lp, t, self._piece(t)) for lp, t in zip(self.logprobs, self.output_ids, strict=True)]
            if self.req.top_logprobs_num > 0:
                tops = [[(lp, t, self._piece(t)) for lp, t in row.top] for row in self.top]
            if self.req.token_ids_logprob:
                want = self.req.token_ids_logprob
                ids = [
                    [(lp, t, self._piece(t)) for lp, t in zip(row.ids, want, strict=True)] for row in self.top
                ]
        done = self.finish is not None
        meta = MetaInfo(
            id=self.req.rid,
            finish_reason=self.finish,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            weight_version=self.weight_version,
            e2e_latency=time.monotonic() - self.started if done else None,
            output_token_logprobs=lps,
            output_top_logprobs=tops,
            output_token_ids_logprobs=ids,
            weight_versions=list(self.spans) if done and self.spans else None,
        )
        return GenerateResponse(text=self._text(), output_ids=list(self.output_ids), meta_info=meta)
