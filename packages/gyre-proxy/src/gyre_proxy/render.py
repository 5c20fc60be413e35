"""Exact-token rendering of a `Conversation` in the Qwen ChatML format, incrementally.

The rendered input is a list of segments (system+tools header, one per turn, the generation prompt), each
tokenized on its own: ChatML puts a special token at every segment boundary, so the concatenation equals
tokenizing the whole text (tested against the model's own Jinja chat template). Each (execution, agent)
keeps the segments of its last render; a new request reuses the segments of its unchanged leading turns,
replaces every assistant turn the proxy produced by the exact ids it recorded and tokenizes only what is
new, so a call's cost grows with the new content, not with the context.

A recorded turn is found by tool-call id or thinking signature (both name the call), else by its text:
first among the asking agent's outputs generated from exactly the conversation that precedes the turn
(the same system, tools and earlier turns, compared by a chained hash), then among every agent's outputs
from that conversation, then among the same agent's outputs, then among the execution's; at each step
several candidates with different ids narrow to those at the same conversation position. Candidates that
still differ are an ambiguity (a retried call): counted, and the turn is tokenized from its text rather
than given another call's ids. Agents with one system prompt share a render cache; a render for another
agent than the last one reuses its turns only as far as this agent's lookups agree.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from gyre_proxy.chat import Conversation, Kind, Turn
from gyre_proxy.exactness import LastCall

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def tool_json(tool: dict[str, Any]) -> str:
    """A tool as the template's `tojson` filter prints it (transformers: json.dumps, ensure_ascii off)."""
    return json.dumps(tool, ensure_ascii=False)


class ContextTooLong(ValueError):
    """A prompt longer than the model's context (413); `at_least`: counted only until it could not fit."""

    def __init__(self, n: int, limit: int, at_least: bool = True) -> None:
        what = f"at least {n}" if at_least else str(n)
        super().__init__(f"prompt is {what} tokens; the model's context is {limit} tokens")
        self.n = n
        self.limit = limit


class Segment:
    """Token ids of one piece of the rendered input, with their JSON text cached for the engine body."""

    __slots__ = ("call_id", "ids", "json")

    def __init__(self, ids: np.ndarray, call_id: str = "") -> None:
        self.ids = ids
        self.json = b",".join(str(int(i)).encode() for i in ids) if ids.size < 64 else _ids_json(ids)
        self.call_id = call_id  # non-empty: recorded output of this call (exact sampled ids)


def _ids_json(ids: np.ndarray) -> bytes:
    return ",".join(map(str, ids.tolist())).encode()


class Joined:
    """The concatenated ids and JSON of a list of segments, with where each segment ends in both, so a
    render that keeps the first k segments of the last one copies their joined prefix instead of
    joining thousands of small pieces again."""

    __slots__ = ("ends", "ids", "json", "json_ends")

    def __init__(self) -> None:
        self.ids = np.zeros(0, np.int32)
        self.json = b""
        self.ends = [0]  # ends[k]: tokens in the first k segments
        self.json_ends = [0]  # json_ends[k]: bytes of the first k segments' JSON, joined by ","

    def extended(self, keep: int, segments: list[Segment]) -> Joined:
        """The first `keep` segments of this one, then `segments`."""
        out = Joined()
        out.ends = self.ends[: keep + 1]
        out.json_ends = self.json_ends[: keep + 1]
        pieces = [s.json for s in segments if s.ids.size]
        head = self.json[: out.json_ends[-1]]
        tail = b",".join(pieces)
        out.json = head + b"," + tail if head and tail else head or tail
        out.ids = np.concatenate([self.ids[: out.ends[-1]], *(s.ids for s in segments)])
        n, j = out.ends[-1], out.json_ends[-1]
        for s in segments:
            if s.ids.size:
                n += int(s.ids.size)
                j += len(s.json) + (1 if j else 0)
            out.ends.append(n)
            out.json_ends.append(j)
        return out


@dataclass
class Rendered:
    """A rendered input: its segments, and how much of it was reused, recorded or newly tokenized."""

    segments: list[Segment]
    reused_tokens: int
    recorded_tokens: int
    tokenized_tokens: int
    tokenized_chars: int
    gen_prompt: np.ndarray
    context: int = 0  # chained hash of the system, tools and every turn (names the exact conversation)
    ambiguous: int = 0  # assistant turns with several recorded candidates (tokenized from text instead)
    joined: Joined | None = None  # the segments' ids and JSON, joined (built on first use if None)

    def _joined(self) -> Joined:
        if self.joined is None:
            self.joined = Joined().extended(0, self.segments)
        return self.joined

    def ids(self) -> np.ndarray:
        return self._joined().ids

    def ids_json(self) -> bytes:
        return self._joined().json

    @property
    def n_tokens(self) -> int:
        return int(self._joined().ids.size)


@dataclass
class RecordedOutput:
    """The assistant turn of one call as it will appear in later inputs: gen prompt + output + close,
    with where it came from (its agent, the conversation it answered and that conversation's length)."""

    call_id: str
    segment: Segment
    agent: str = ""
    context: int = 0
    position: int = -1


@dataclass
class AgentCache:
    """Per (execution, system+tools header): the last render's keys, segments and context hashes
    (`chain[k]`: the system, tools and first k turns), and its last call."""

    keys: list[Any] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    joined: Joined = field(default_factory=Joined)
    chain: list[int] = field(default_factory=list)
    agent: str = ""  # the agent the last render was for (its recorded turns are that agent's lookups)
    last_call_id: str = ""
    last_full: np.ndarray | None = None  # last call's input + output


@dataclass
class ExecutionCache:
    """Everything the proxy keeps for one execution: render caches (per system+tools header), the recorded
    outputs, and each agent's last call (`exactness`)."""

    agents: OrderedDict[str, AgentCache] = field(default_factory=OrderedDict)
    by_tool_id: dict[str, RecordedOutput] = field(default_factory=dict)
    by_signature: dict[str, RecordedOutput] = field(default_factory=dict)
    by_text: dict[str, list[RecordedOutput]] = field(default_factory=dict)  # in call order
    last_calls: OrderedDict[str, LastCall] = field(default_factory=OrderedDict)  # by agent id
    non_extensions: int = 0

    def remember(self, agent: str, last: LastCall, max_agents: int) -> None:
        """Keep `last` as `agent`'s last call; the `max_agents` most recent agents keep theirs (each
        holds its call's input + output ids: a fork holds its parent's whole context)."""
        self.last_calls[agent] = last
        self.last_calls.move_to_end(agent)
        while len(self.last_calls) > max_agents:
            self.last_calls.popitem(last=False)

    def forget_renders(self) -> None:
        """Drop what grows with the context (render caches, last calls); keep the recorded outputs."""
        self.agents.clear()
        self.last_calls.clear()

    def agent(self, key: str, max_agents: int) -> AgentCache:
        ac = self.agents.get(key)
        if ac is None:
            ac = self.agents[key] = AgentCache()
            while len(self.agents) > max_agents:
                self.agents.popitem(last=False)
        else:
            self.agents.move_to_end(key)
        return ac


def text_key(text: str) -> str:
    return hashlib.blake2b(text.strip().encode(), digest_size=16).hexdigest()


def _distinct(cands: list[RecordedOutput]) -> list[RecordedOutput]:
    """Candidates with different ids (outputs with the same ids are the same tokens, whichever call)."""
    out: list[RecordedOutput] = []
    for c in cands:
        if not any(np.array_equal(c.segment.ids, o.segment.ids) for o in out):
            out.append(c)
    return out


def _narrow(cands: list[RecordedOutput], position: int) -> tuple[RecordedOutput | None, bool]:
    """(the one candidate, ambiguous): one distinct candidate, or one at `position`."""
    distinct = _distinct(cands)
    if len(distinct) == 1:
        return distinct[0], False
    at = _distinct([c for c in cands if c.position == position])
    if len(at) == 1:
        return at[0], False
    return None, len(distinct) > 1


class Renderer:
    """Renders conversations for one tokenizer; thread-compatible (callers serialize per execution)."""

    def __init__(self, tokenizer: Tokenizer, max_agents_per_execution: int = 16) -> None:
        self.tok = tokenizer
        self.max_agents = max_agents_per_execution
        im_end = tokenizer.token_to_id(IM_END)
        if im_end is None or tokenizer.token_to_id(IM_START) is None:
            raise ValueError("the tokenizer has no <|im_start|>/<|im_end|> tokens: not a ChatML (Qwen) model")
        self.im_end = int(im_end)
        self.newline = self.encode("\n")
        eos = tokenizer.token_to_id("<|endoftext|>")
        self.stop_ids = {self.im_end} | ({int(eos)} if eos is not None else set())
        # The most characters one token can stand for: a byte-level BPE token's vocabulary entry has one
        # character per byte, so a text of c characters has at least c // max_token_chars tokens.
        self.max_token_chars = max(1, max(map(len, tokenizer.get_vocab(with_added_tokens=True))))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    # ------------------------------------------------------------------ text of each segment
    @staticmethod
    def header_text(conv: Conversation) -> str:
        if conv.tools_json:
            sys = f"{conv.system}\n\n" if conv.system else ""
            tools = "".join("\n" + t for t in conv.tools_json)
            return f"{IM_START}system\n{sys}{TOOLS_PREAMBLE}{tools}{TOOLS_POSTAMBLE}{IM_END}\n"
        if conv.system:
            return f"{IM_START}system\n{conv.system}{IM_END}\n"
        return ""

    @staticmethod
    def gen_prompt_text(thinking: bool) -> str:
        return f"{IM_START}assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")

    @staticmethod
    def turn_text(t: Turn, prev_tool: bool, next_tool: bool, after_last_user: bool) -> str:
        if t.kind is Kind.USER:
            return f"{IM_START}user\n{t.text}{IM_END}\n"
        if t.kind is Kind.SYSTEM:
            return f"{IM_START}system\n{t.text}{IM_END}\n"
        if t.kind is Kind.TOOL:
            head = "" if prev_tool else f"{IM_START}user\n"
            tail = "\n" if next_tool else f"{IM_END}\n"
            body = f"Error: {t.text}" if t.is_error else t.text
            return f"{head}<tool_response>\n{body}\n</tool_response>{tail}"
        think = f"<think>\n{t.reasoning}\n</think>\n\n" if t.reasoning and after_last_user else ""
        calls = "".join(
            f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>'
            for c in t.tool_calls
        )
        return f"{IM_START}assistant\n{think}{t.text}{calls}{IM_END}\n"

    def full_text(self, conv: Conversation) -> str:
        """The whole prompt as text (the re-render-everything path, for comparison and the benchmark)."""
        parts = [self.header_text(conv)]
        last_user = max((i for i, t in enumerate(conv.turns) if t.kind is Kind.USER), default=-1)
        n = len(conv.turns)
        for i, t in enumerate(conv.turns):
            prev_tool = i > 0 and conv.turns[i - 1].kind is Kind.TOOL
            next_tool = i + 1 < n and conv.turns[i + 1].kind is Kind.TOOL
            parts.append(self.turn_text(t, prev_tool, next_tool, i > last_user))
        parts.append(self.gen_prompt_text(conv.thinking))
        return "".join(parts)

    # ------------------------------------------------------------------ incremental, exact render
    def find_recorded(
        self, ex: ExecutionCache, t: Turn, position: int, context: int, agent: str
    ) -> tuple[RecordedOutput | None, bool]:
        """(the recorded output of assistant turn `t`, ambiguous). `position`: how many turns precede
        it; `context`: the chained hash of what precedes it; `agent`: who is asking."""
        for c in t.tool_calls:
            rec = ex.by_tool_id.get(c.id)
            if rec is not None:
                return rec, False
        if t.signature:
            rec = ex.by_signature.get(t.signature)
            if rec is not None:
                return rec, False
        if t.tool_calls:
            return None, False
        outs = ex.by_text.get(text_key(t.text))
        if not outs:
            return None, False
        exact = [o for o in outs if o.context == context]
        for group in (
            [o for o in exact if o.agent == agent],  # the asking agent's own answer to exactly this
            exact,
            [o for o in outs if o.agent == agent],
            outs,
        ):
            if group:
                return _narrow(group, position)
        return None, False

    def agent_key(self, conv: Conversation) -> str:
        h = hashlib.blake2b(conv.system.encode(), digest_size=12)
        for t in conv.tools_json:
            h.update(t.encode())
        return h.hexdigest()

    @staticmethod
    def _chain(conv: Conversation, ac: AgentCache, same: int) -> list[int]:
        """Context hashes of `conv` (chain[k]: system, tools and the first k turns), reusing the first
        `same` of the agent's last render (its keys agreed that far: header and turns[:same - 1])."""
        chain = ac.chain[:same] if same else [hash((conv.system, conv.tools_json))]
        for k in range(len(chain), len(conv.turns) + 1):
            chain.append(hash((chain[k - 1], conv.turns[k - 1])))
        return chain

    def _same_lookups(
        self, ex: ExecutionCache, ac: AgentCache, keys: list[Any], same: int, agent: str
    ) -> int:
        """How many of the `same` leading segments of another agent's last render `agent` may reuse: up to
        the first assistant turn this agent's lookup would settle differently (another recorded output,
        or none where that render found one, or one where it found none)."""
        for j in range(1, same):
            t = keys[j][0]
            if not isinstance(t, Turn) or t.kind is not Kind.ASSISTANT:
                continue
            rec, _ = self.find_recorded(ex, t, j - 1, ac.chain[j - 1], agent)
            old = ac.segments[j]
            if (rec.segment is not old) if rec is not None else bool(old.call_id):
                return j
        return same

    def render(
        self, conv: Conversation, ex: ExecutionCache, agent: str = "", limit: int = 0
    ) -> tuple[Rendered, AgentCache]:
        """The exact ids of `conv` for `agent` (whose recorded outputs are preferred for its turns). With
        `limit`, a prompt that has at least `limit` tokens raises `ContextTooLong`, and new text is
        tokenized only while it can still fit (so the work and memory a request costs are bounded)."""
        ac = ex.agent(self.agent_key(conv), self.max_agents)
        turns = conv.turns
        n = len(turns)
        last_user = max((i for i, t in enumerate(turns) if t.kind is Kind.USER), default=-1)
        keys: list[Any] = [("h", conv.system, conv.tools_json)]
        for i, t in enumerate(turns):
            prev_tool = i > 0 and turns[i - 1].kind is Kind.TOOL
            next_tool = i + 1 < n and turns[i + 1].kind is Kind.TOOL
            # the template shows an assistant turn's reasoning only after the last user turn
            keys.append((t, prev_tool, next_tool, bool(t.reasoning) and i > last_user))
        keys.append(("g", conv.thinking))
        same = 0
        old = ac.keys
        common = min(len(old), len(keys))
        while same < common and old[same] == keys[same]:
            same += 1
        if same > 1 and ac.agent != agent:
            same = self._same_lookups(ex, ac, keys, same, agent)
        segs = ac.segments[:same]
        chain = self._chain(conv, ac, same)
        known: dict[Any, Segment] | None = None  # old segments by key, built only if a turn diverged
        reused = ac.joined.ends[same]
        recorded = tokenized = chars = ambiguous = 0
        for j in range(same, len(keys)):
            if j == 0:
                text = self.header_text(conv)
            elif j == len(keys) - 1:
                text = self.gen_prompt_text(conv.thinking)
            else:
                t, prev_tool, next_tool, after = keys[j]
                if t.kind is Kind.ASSISTANT:
                    rec, unsure = self.find_recorded(ex, t, j - 1, chain[j - 1], agent)
                    ambiguous += unsure
                    if rec is not None:
                        segs.append(rec.segment)
                        recorded += int(rec.segment.ids.size)
                        continue
                hit = None
                if j < len(old):  # a change before this turn (an edit, a new user turn): look it up
                    if known is None:
                        known = {k: sg for k, sg in zip(old, ac.segments, strict=True) if not sg.call_id}
                    hit = known.get(keys[j])
                if hit is not None:  # unchanged turn behind a change (an edit or a new user turn)
                    segs.append(hit)
                    reused += int(hit.ids.size)
                    continue
                text = self.turn_text(t, prev_tool, next_tool, after)
            least = reused + recorded + tokenized + len(text) // self.max_token_chars
            if limit and least >= limit:  # refused before tokenizing text that cannot fit anyway
                raise ContextTooLong(least, limit)
            seg = Segment(self.encode(text)) if text else Segment(np.zeros(0, np.int32))
            tokenized += int(seg.ids.size)
            chars += len(text)
            segs.append(seg)
        joined = ac.joined.extended(same, segs[same:])
        ac.keys = keys
        ac.segments = segs
        ac.joined = joined
        ac.chain = chain
        ac.agent = agent
        out = Rendered(segs, reused, recorded, tokenized, chars, segs[-1].ids, chain[-1], ambiguous, joined)
        return out, ac

    def render_full(self, conv: Conversation, limit: int = 0) -> Rendered:
        """Render and tokenize the whole prompt from scratch (what a proxy without a cache does)."""
        text = self.full_text(conv)
        if limit and len(text) // self.max_token_chars >= limit:
            raise ContextTooLong(len(text) // self.max_token_chars, limit)
        ids = self.encode(text)
        gen = self.encode(self.gen_prompt_text(conv.thinking))
        return Rendered([Segment(ids)], 0, 0, int(ids.size), len(text), gen)

    def record_output(
        self,
        ex: ExecutionCache,
        call_id: str,
        gen_prompt: np.ndarray,
        output_ids: np.ndarray,
        tool_ids: list[str],
        signature: str,
        text: str,
        *,
        agent: str = "",
        context: int = 0,
        position: int = -1,
    ) -> RecordedOutput:
        """Remember a call's output as the exact ids of its assistant turn in later inputs. `text` is its
        text blocks joined as the APIs return them; an output without tool calls is also found by it
        (an empty one too). `context` / `position`: the rendered conversation it answered (`Rendered`)."""
        close: list[np.ndarray] = []
        if (
            not (output_ids.size and int(output_ids[-1]) in self.stop_ids)
            or int(output_ids[-1]) != self.im_end
        ):
            close.append(np.asarray([self.im_end], np.int32))
        ids = np.concatenate([gen_prompt, output_ids.astype(np.int32), *close, self.newline])
        rec = RecordedOutput(call_id, Segment(ids, call_id), agent, context, position)
        for tid in tool_ids:
            ex.by_tool_id[tid] = rec
        if signature:
            ex.by_signature[signature] = rec
        if not tool_ids:
            ex.by_text.setdefault(text_key(text), []).append(rec)
        return rec
