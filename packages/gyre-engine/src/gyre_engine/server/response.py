"""Accumulates a request's token events into SGLang's /generate response (or a cumulative stream chunk).

Text is decoded from all output ids each time (so multi-byte characters split over tokens come out
whole); a matched stop string is cut from the text unless `no_stop_trim`. `output_ids` keep every sampled
token, the stop token included, because the trainer must see exactly what was sampled.
"""

from __future__ import annotations

import time
from typing import Any

from gyre_engine.protocol import FinishReason, GenerateResponse, LogprobEntry, MetaInfo
from gyre_engine.server.request import EngineRequest, TokenEvent


class ResponseBuilder:
    """Folds TokenEvents of one request into a GenerateResponse."""

    def __init__(self, req: EngineRequest, tokenizer: Any) -> None:
        self.req = req
        self.tok = tokenizer
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[float, int]]] = []
        self.finish: FinishReason | None = None
        self.prompt_tokens = len(req.input_ids)
        self.cached_tokens = 0
        self.weight_version = "0"
        self.started = time.monotonic()

    def add(self, ev: TokenEvent) -> None:
        self.output_ids.extend(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        if ev.top is not None:
            self.top.extend(ev.top)
        self.finish = ev.finish
        self.cached_tokens = ev.cached_tokens
        self.weight_version = ev.weight_version

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
        lps: list[LogprobEntry] | None = None
        tops: list[list[LogprobEntry] | None] | None = None
        if self.req.return_logprob:
            lps = [(lp, t, self._piece(t)) for lp, t in zip(self.logprobs, self.output_ids, strict=True)]
            if self.req.top_logprobs_num > 0:
                tops = [[(lp, t, self._piece(t)) for lp, t in row] for row in self.top]
        meta = MetaInfo(
            id=self.req.rid,
            finish_reason=self.finish,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            weight_version=self.weight_version,
            e2e_latency=time.monotonic() - self.started,
            output_token_logprobs=lps,
            output_top_logprobs=tops,
        )
        return GenerateResponse(text=self._text(), output_ids=list(self.output_ids), meta_info=meta)
