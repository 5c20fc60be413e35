"""Logs of model calls made through OpenAI-compatible servers (vLLM, SGLang), and Anthropic Messages
calls, become calls (one per choice, with the exact ids the server tokenized and sampled) and scores
where the logger recorded rewards. Ids and logprobs are read only from where those servers put them when
asked (`MessageLogReader` lists them); a line without them is an error naming what is missing and the
request option that supplies it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from gyre_traj.readers import rows
from gyre_traj.records import Call, RecordError, Role, Score, as_logprobs

EXECUTION_KEYS = ("execution_id", "session_id", "trajectory_id", "conversation_id", "rollout_id")
"""Keys of a log line (then the request's `session_id`) naming the execution a call belongs to."""
ANTHROPIC_FINISH = {
    "end_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "stop_sequence": "stop",
}
_TOKEN_ID = re.compile(r"token_id:(\d+)")

NO_PROMPT_IDS = (
    "no prompt token ids: vLLM returns them as the response's `prompt_token_ids` (request "
    "`return_token_ids: true`), SGLang as each choice's `prompt_token_ids` (request "
    "`return_prompt_token_ids: true`); a request that sent ids (`input_ids`, or a completions `prompt` "
    "of ids) supplies them too"
)
NO_OUTPUT_IDS = (
    "no output token ids: each choice's `token_ids` (request `return_token_ids: true`, vLLM and SGLang), "
    "or vLLM's logprob tokens as `token_id:<id>` (request `return_tokens_as_token_ids: true`)"
)
NO_LOGPROBS = "no output logprobs: each choice's `logprobs` (request `logprobs: true`)"
NO_ANTHROPIC_IDS = (
    "an Anthropic Messages response carries no token ids or logprobs (neither Anthropic's API nor "
    "vLLM's or SGLang's /v1/messages returns them): add `prompt_token_ids`, `token_ids` and "
    "`output_logprobs` to the log line, or log the server's OpenAI-compatible endpoint with "
    "`logprobs: true` and `return_token_ids: true`"
)


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


def _assemble_stream(chunks: list[Any], where: str) -> dict[str, Any]:
    """A streamed OpenAI-compatible response (its chunks in order) as the one response it adds up to:
    per choice, the output ids (vLLM sends each chunk's as `token_ids`; SGLang's chunks carry none)
    and logprobs concatenated, the last finish reason kept; the prompt ids from whichever chunk
    carries them (vLLM: the first)."""
    first = next((c for c in chunks if isinstance(c, dict)), None)
    if first is None:
        raise RecordError(f"{where}: a streamed response with no chunk")
    chat = first.get("object") == "chat.completion.chunk"
    out: dict[str, Any] = {
        "object": "chat.completion" if chat else "text_completion",
        "id": first.get("id"),
        "created": first.get("created"),
    }
    choices: dict[int, dict[str, Any]] = {}
    for k, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices", []), list):
            raise RecordError(f"{where}: stream chunk {k} is not a response chunk")
        if chunk.get("prompt_token_ids") is not None:
            out["prompt_token_ids"] = chunk["prompt_token_ids"]
        for c in chunk.get("choices") or []:
            if not isinstance(c, dict):
                raise RecordError(f"{where}: stream chunk {k} has a choice that is not an object")
            index = c.get("index", 0)
            if isinstance(index, bool) or not isinstance(index, int):
                raise RecordError(f"{where}: stream chunk {k} has a choice `index` that is not an integer")
            acc = choices.setdefault(index, {"index": index, "_lps": None})
            if c.get("prompt_token_ids") is not None:
                acc["prompt_token_ids"] = c["prompt_token_ids"]
            if isinstance(c.get("token_ids"), list):
                acc["token_ids"] = acc.get("token_ids", []) + c["token_ids"]
            lp = c.get("logprobs")
            if isinstance(lp, dict):
                part = lp.get("content") if chat else lp.get("token_logprobs")
                if isinstance(part, list):
                    acc["_lps"] = (acc["_lps"] or []) + part
            if c.get("finish_reason") is not None:
                acc["finish_reason"] = c["finish_reason"]
    out["choices"] = []
    for acc in choices.values():
        lps = acc.pop("_lps")
        if lps is not None:
            acc["logprobs"] = {"content": lps} if chat else {"token_logprobs": lps}
        out["choices"].append(acc)
    return out


def _is_anthropic_stream(events: list[Any]) -> bool:
    return bool(events) and isinstance(events[0], dict) and events[0].get("type") == "message_start"


def _assemble_anthropic_stream(events: list[Any]) -> dict[str, Any]:
    """A streamed Anthropic Messages response as the message it adds up to (its id and stop reason: the
    only parts read; the ids come from the logger's fields)."""
    start = _get(events[0], "message") or {}
    stop = next(
        (
            _get(_get(e, "delta"), "stop_reason")
            for e in reversed(events)
            if _get(e, "type") == "message_delta"
        ),
        None,
    )
    return {"type": "message", "id": _get(start, "id"), "stop_reason": stop}


def _prompt_source(resp: dict[str, Any], choice: dict[str, Any], req: Any) -> tuple[Any, str] | None:
    """(the prompt's ids as logged, the field they are in), or None when the log has none."""
    for raw, field in (
        (choice.get("prompt_token_ids"), "choices[].prompt_token_ids"),
        (resp.get("prompt_token_ids"), "prompt_token_ids"),
        (_get(req, "input_ids"), "request.input_ids"),
    ):
        if raw is not None:
            return raw, field
    prompt = _get(req, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        return prompt, "request.prompt"
    return None


def _logprobs_of(resp: dict[str, Any], choice: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
    """(logprob values, their tokens) as a choice logs them (chat: `logprobs.content[]`, completions:
    `logprobs.token_logprobs` and `logprobs.tokens`), or None when it has no logprobs."""
    lp = choice.get("logprobs")
    if resp.get("object") == "text_completion":
        values = _get(lp, "token_logprobs")
        tokens = _get(lp, "tokens")
        return (values, tokens if isinstance(tokens, list) else []) if isinstance(values, list) else None
    content = _get(lp, "content")
    if not isinstance(content, list):
        return None
    entries = [e if isinstance(e, dict) else {} for e in content]
    return [e.get("logprob") for e in entries], [e.get("token") for e in entries]


def _ids_in_tokens(tokens: list[Any]) -> list[int] | None:
    """The ids vLLM writes as logprob tokens `token_id:<id>` (`return_tokens_as_token_ids`), when every
    token is written so."""
    found = [m.group(1) for t in tokens if isinstance(t, str) and (m := _TOKEN_ID.fullmatch(t))]
    return [int(t) for t in found] if tokens and len(found) == len(tokens) else None


def _missing(resp: dict[str, Any], choice: dict[str, Any], req: Any) -> list[str]:
    """What of prompt ids, output ids and logprobs a choice lacks, each with where it would come from."""
    out = [] if _prompt_source(resp, choice, req) is not None else [NO_PROMPT_IDS]
    logged = _logprobs_of(resp, choice)
    if choice.get("token_ids") is None and (logged is None or _ids_in_tokens(logged[1]) is None):
        out.append(NO_OUTPUT_IDS)
    if logged is None:
        out.append(NO_LOGPROBS)
    return out


def _prompt_ids(resp: dict[str, Any], choice: dict[str, Any], req: Any, where: str) -> np.ndarray:
    source = _prompt_source(resp, choice, req)
    if source is None:
        raise RecordError(f"{where}: {NO_PROMPT_IDS}")
    return rows.ids(source[0], where, source[1])


def _output(resp: dict[str, Any], choice: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(output ids, logprobs) of one choice (`_missing` has found them there)."""
    logged = _logprobs_of(resp, choice)
    assert logged is not None
    values, tokens = logged
    field = (
        "logprobs.token_logprobs" if resp.get("object") == "text_completion" else "logprobs.content[].logprob"
    )
    if any(v is None for v in values):
        raise RecordError(f"{where}: `{field}` has a null entry (every output token needs its logprob)")
    try:
        lps = as_logprobs(rows.floats(values, where, field))
    except ValueError as exc:
        raise RecordError(f"{where}: `{field}`: {exc}") from None
    by_token = _ids_in_tokens(tokens)
    if choice.get("token_ids") is not None:
        out = rows.ids(choice["token_ids"], where, "choices[].token_ids")
        if by_token is not None and by_token != out.tolist():
            raise RecordError(f"{where}: `token_ids` disagree with the `token_id:<id>` logprob tokens")
    else:
        assert by_token is not None
        out = rows.ids(by_token, where, "logprob tokens")
    if out.shape[0] != lps.shape[0]:
        raise RecordError(f"{where}: {lps.shape[0]} output logprobs for {out.shape[0]} output ids")
    return out, lps


def _anthropic(line: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not all(line.get(f) is not None for f in ("prompt_token_ids", "token_ids", "output_logprobs")):
        raise RecordError(f"{where}: {NO_ANTHROPIC_IDS}")
    prompt = rows.ids(line["prompt_token_ids"], where, "prompt_token_ids")
    out = rows.ids(line["token_ids"], where, "token_ids")
    lps = rows.floats(line["output_logprobs"], where, "output_logprobs")
    if lps.shape[0] != out.shape[0]:
        raise RecordError(f"{where}: {lps.shape[0]} `output_logprobs` for {out.shape[0]} `token_ids`")
    try:
        return prompt, out, as_logprobs(lps)
    except ValueError as exc:
        raise RecordError(f"{where}: `output_logprobs`: {exc}") from None


class MessageLogReader:
    """Turns log lines into records. A line is one JSON object: a response as the server returned it,
    or `{"request": ..., "response": ...}` with keys of the logger's (an execution key from
    `EXECUTION_KEYS`, `group_id`, `reward`, `call_id`, `agent_id`, `role`, `weight_version`); a streamed
    response is the list of its chunks (events, for Anthropic).

    The prompt's ids: vLLM's `prompt_token_ids` (request `return_token_ids`), SGLang's per-choice
    `prompt_token_ids` (request `return_prompt_token_ids`), or the request's own ids (`input_ids`, a
    completions `prompt` of ids). Each choice's output ids: `token_ids` (request `return_token_ids`),
    or vLLM's logprob tokens written `token_id:<id>` (`return_tokens_as_token_ids`); its logprobs under
    `logprobs` (request `logprobs`). Anthropic Messages responses carry none of these, from any server:
    such a line is read when the logger added `prompt_token_ids`, `token_ids` and `output_logprobs`."""

    def __init__(self, default_execution: str = "messages", reward_key: str | None = None) -> None:
        self.default_execution = default_execution
        self.reward_key = reward_key
        self._book = rows.ScoreBook()

    def _execution(self, line: dict[str, Any], req: Any) -> str:
        for key in EXECUTION_KEYS:
            if line.get(key) is not None:
                return str(line[key])
        sid = _get(req, "session_id")
        return self.default_execution if sid is None else str(sid)

    def records(self, line: dict[str, Any], where: str) -> list[Call | Score]:
        exchange = "response" in line
        resp = line["response"] if exchange else line
        req = line.get("request") if exchange else None
        if isinstance(resp, list):
            resp = (
                _assemble_anthropic_stream(resp)
                if _is_anthropic_stream(resp)
                else _assemble_stream(resp, where)
            )
        if not isinstance(resp, dict):
            raise RecordError(f"{where}: `response` must be a response object or a list of stream chunks")
        execution = self._execution(line, req)
        role_raw = line.get("role", "main")
        try:
            role = Role(role_raw)
        except ValueError:
            raise RecordError(
                f"{where}: unknown role {role_raw!r:.40} (one of {[r.value for r in Role]})"
            ) from None
        raw_version = line.get("weight_version", _get(resp.get("metadata"), "weight_version"))
        common: dict[str, Any] = dict(
            execution_id=execution,
            agent_id=str(line.get("agent_id", "main")),
            role=role,
            weight_version=0 if raw_version is None else rows.version(raw_version, where, "weight_version"),
        )
        created = resp.get("created")
        if isinstance(created, int | float) and not isinstance(created, bool):
            common["t_start"] = common["t_end"] = float(created)
        base = str(line.get("call_id") or resp.get("id") or where.rsplit(":", 1)[-1])
        calls: list[Call] = []
        if resp.get("type") == "message":  # Anthropic Messages
            prompt, out, lps = _anthropic(line, where)
            finish = ANTHROPIC_FINISH.get(str(resp.get("stop_reason")), "stop")
            calls.append(self._call(where, base, prompt, out, lps, finish, common))
        elif isinstance(resp.get("choices"), list) and resp["choices"]:
            choices = resp["choices"]
            for k, choice in enumerate(choices):
                if not isinstance(choice, dict):
                    raise RecordError(f"{where}: `choices[{k}]` is not an object")
                cid = base if len(choices) == 1 else f"{base}/{choice.get('index', k)}"
                if missing := _missing(resp, choice, req):
                    raise RecordError(f"{where}: " + "; ".join(missing))
                prompt = _prompt_ids(resp, choice, req, where)
                out, lps = _output(resp, choice, where)
                finish = str(choice.get("finish_reason") or "stop")
                calls.append(self._call(where, cid, prompt, out, lps, finish, common))
        else:
            raise RecordError(
                f"{where}: not a chat or text completion (no `choices`) nor an Anthropic message "
                "(`type: message`)"
            )
        group = line.get("group_id")
        value = rows.reward(line.get("reward"), where, "reward", self.reward_key)
        score = self._book.score(execution, execution if group is None else str(group), value, where)
        return [*calls, score] if score is not None else list(calls)

    @staticmethod
    def _call(
        where: str,
        call_id: str,
        prompt: np.ndarray,
        out: np.ndarray,
        lps: np.ndarray,
        finish: str,
        common: dict[str, Any],
    ) -> Call:
        try:
            return Call(
                call_id=call_id,
                input_ids=prompt,
                output_ids=out,
                output_logprobs=lps,
                finish_reason=finish,
                **common,
            )
        except RecordError as exc:
            raise RecordError(f"{where}: {exc}") from None


def iter_messages(
    lines: Iterable[bytes | str],
    name: str = "<stream>",
    *,
    default_execution: str = "messages",
    reward_key: str | None = None,
) -> Iterator[Call | Score]:
    """Records of a message log (see the module docstring). Lines naming no execution belong to
    `default_execution`."""
    reader = MessageLogReader(default_execution, reward_key)
    for where, obj in rows.rows(lines, name):
        yield from reader.records(obj, where)
