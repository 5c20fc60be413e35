"""Turns a /generate body into the engine's requests, reading it as SGLang 0.5.23 does.

One input or a batch (lists of `input_ids` or `text`); `null` for any field means its default; in a batch
the per-request fields (`sampling_params`, `rid`, `return_logprob`, `logprob_start_len`,
`top_logprobs_num`, `token_ids_logprob`) are one value for all inputs or a list with one per input.
`max_new_tokens: null` is SGLang's "no limit", bounded (as SGLang bounds every request) by the context:
at most `context_len - len(input_ids) - 1` new tokens. What gyre-engine cannot do is refused here with a
ProtocolError naming it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import msgspec

from gyre_engine.protocol import GenerateRequest, ProtocolError, sampling_params_from
from gyre_engine.server.request import EngineRequest


def is_single(req: GenerateRequest) -> bool:
    """One input (`text` a string, `input_ids` a flat list), not a batch."""
    if req.text is not None:
        return isinstance(req.text, str)
    return not req.input_ids or isinstance(req.input_ids[0], int)


def per_input[T](name: str, value: T | list[T] | None, default: T, n: int, single: bool) -> list[T]:
    """`value` for each of `n` inputs: null -> the default, a scalar -> repeated, a list -> one each."""
    if value is None:
        return [default] * n
    if not isinstance(value, list) or single:
        return [value] * n  # type: ignore[list-item]
    if len(value) != n:
        raise ProtocolError(f"{name} has {len(value)} values for {n} inputs")
    return [default if v is None else v for v in value]


def token_id_lists(value: list[int | list[int]] | None, n: int, single: bool) -> list[list[int] | None]:
    """SGLang's `token_ids_logprob`: one flat list for every input, or (in a batch) a list per input."""
    if not value:
        return [None] * n
    if all(isinstance(v, int) for v in value):
        return [list(value)] * n  # type: ignore[arg-type]
    if single or not all(isinstance(v, list) for v in value):
        raise ProtocolError("token_ids_logprob must be a flat list of integers")
    if len(value) != n:
        raise ProtocolError(f"token_ids_logprob has {len(value)} lists for {n} inputs")
    return [list(v) or None for v in value]  # type: ignore[arg-type]


def input_id_lists(
    req: GenerateRequest, tokenize: Callable[[str], list[int]], single: bool
) -> list[list[int]]:
    if req.input_ids is not None and req.text is not None:
        raise ProtocolError("give either input_ids or text, not both")
    if req.input_ids is None and req.text is None:
        raise ProtocolError("input_ids (or text) is required")
    if req.text is not None:
        return [tokenize(t) for t in ([req.text] if isinstance(req.text, str) else req.text)]
    assert req.input_ids is not None
    if len({isinstance(x, int) for x in req.input_ids}) > 1:
        raise ProtocolError("input_ids must be a list of token ids or a list of such lists, not a mix")
    return [req.input_ids] if single else [list(x) for x in req.input_ids]  # type: ignore[list-item,arg-type]


def parse_generate(
    req: GenerateRequest, tokenize: Callable[[str], list[int]], context_len: int
) -> list[EngineRequest]:
    """The engine requests of one /generate body (one, or one per input of a batch)."""
    single = is_single(req)
    ids_list = input_id_lists(req, tokenize, single)
    n = len(ids_list)
    if not single and req.stream:
        raise ProtocolError(
            "streaming a batch of inputs is not supported by gyre-engine; send them one by one"
        )
    sps = per_input("sampling_params", req.sampling_params, {}, n, single)
    rids: list[str | None] = per_input("rid", req.rid, None, n, single)  # type: ignore[arg-type]
    want_lp = per_input("return_logprob", req.return_logprob, False, n, single)
    starts = per_input("logprob_start_len", req.logprob_start_len, -1, n, single)
    tops = per_input("top_logprobs_num", req.top_logprobs_num, 0, n, single)
    ids_lp = token_id_lists(req.token_ids_logprob, n, single)
    out = []
    for i, ids in enumerate(ids_list):
        want = ids_lp[i]
        if not isinstance(sps[i], dict):
            raise ProtocolError("sampling_params must be an object (or a list of objects, one per input)")
        if want_lp[i] and starts[i] >= 0:
            raise ProtocolError(
                "input token logprobs (logprob_start_len >= 0) are not supported by gyre-engine"
            )
        params = sampling_params_from(sps[i])
        if params.max_new_tokens is None:
            params = msgspec.structs.replace(params, max_new_tokens=max(0, context_len - len(ids) - 1))
        out.append(
            EngineRequest(
                rid=rids[i] or uuid.uuid4().hex,
                input_ids=list(ids),
                params=params,
                return_logprob=bool(want_lp[i]),
                top_logprobs_num=int(tops[i]) if want_lp[i] else 0,
                return_text_in_logprobs=bool(req.return_text_in_logprobs),
                token_ids_logprob=tuple(want) if want_lp[i] and want else None,
            )
        )
    return out
