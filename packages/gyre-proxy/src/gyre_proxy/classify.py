"""Per-harness classifiers: which agent loop made a call (main, main_summary, subagent, subagent_summary)
and its agent id.

A harness-given agent id wins: the first of the configured headers present (Claude Code 2.1.328 sends
`x-claude-code-agent-id`, unique per sub-agent and fork, on every sub-agent call and none on the main
loop's; `x-gyre-agent` for other harnesses). Without one, Claude Code's loops (one
`X-Claude-Code-Session-Id` for all) are told apart by the system prompt (read from its real traffic:
sub-agents carry `cc_is_subagent=true` in the billing block, which the proxy strips from what the policy
sees but keeps in `Conversation.stripped`, and "You are an agent for Claude Code"; the main loop says "You
are Claude Code" when interactive and "You are a Claude agent, built on Anthropic's Claude Agent SDK"
under `-p`); the main loop is "main", any other a short hash of its system prompt and first user turn
(the fallback: forks from one state share it). Summaries are recognised by the last user turn
(compaction asks for "a detailed summary of the conversation").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

from gyre_traj.records import Role

from gyre_proxy.chat import Conversation, Kind

SUMMARY_MARKERS = (
    "detailed summary of the conversation",
    "summary of the conversation so far",
    "Your task is to create a detailed summary",
    "summarize the conversation",
)
CC_MAIN_MARKERS = (
    "You are Claude Code, Anthropic's official CLI",  # interactive entry point
    "You are a Claude agent, built on Anthropic's Claude Agent SDK",  # `claude -p` (sdk-cli)
)
CC_SUB_MARKERS = ("cc_is_subagent=true", "You are an agent for Claude Code")


class Classifier(Protocol):
    def __call__(self, conv: Conversation, headers: Mapping[str, str], agent_id: str) -> tuple[Role, str]: ...


def harness_agent_id(headers: Mapping[str, str], names: tuple[str, ...]) -> str:
    """The first non-empty header of `names` (the harness's own agent id), or ""."""
    for name in names:
        value = headers.get(name, "")
        if value:
            return value
    return ""


def _last_user_text(conv: Conversation) -> str:
    for t in reversed(conv.turns):
        if t.kind is Kind.USER:
            return t.text
        if t.kind is Kind.ASSISTANT:
            return ""
    return ""


def _first_user_text(conv: Conversation) -> str:
    return next((t.text for t in conv.turns if t.kind is Kind.USER), "")


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=6)
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def is_summary(conv: Conversation) -> bool:
    last = _last_user_text(conv)
    return any(m.lower() in last.lower() for m in SUMMARY_MARKERS)


def _harness_text(conv: Conversation) -> str:
    """The system prompt and the harness metadata stripped from it."""
    return "\n".join([conv.system, *(text for _, text in conv.stripped)])


def classify_claude_code(
    conv: Conversation, headers: Mapping[str, str], agent_id: str = ""
) -> tuple[Role, str]:
    """Claude Code: a sub-agent when it names itself (`agent_id`) or its system prompt says so."""
    system = _harness_text(conv)
    summary = is_summary(conv)
    main = any(m in system for m in CC_MAIN_MARKERS) and not any(m in system for m in CC_SUB_MARKERS)
    if main and not agent_id:
        return (Role.MAIN_SUMMARY if summary else Role.MAIN), "main"
    agent = agent_id or "sub-" + _digest(conv.system, _first_user_text(conv))
    return (Role.SUBAGENT_SUMMARY if summary else Role.SUBAGENT), agent


def classify_generic(conv: Conversation, headers: Mapping[str, str], agent_id: str = "") -> tuple[Role, str]:
    """Any other harness: one main loop per execution, unless it names its agent (`agent_id`: `main` or
    anything else for a sub-agent) and its role in `X-Gyre-Role`."""
    agent = agent_id or "main"
    role_h = headers.get("x-gyre-role", "")
    if role_h:
        try:
            return Role(role_h), agent
        except ValueError:
            pass
    summary = is_summary(conv)
    if agent == "main":
        return (Role.MAIN_SUMMARY if summary else Role.MAIN), agent
    return (Role.SUBAGENT_SUMMARY if summary else Role.SUBAGENT), agent


def pick_classifier(headers: Mapping[str, str], conv: Conversation) -> Classifier:
    ua = headers.get("user-agent", "").lower()
    if "x-claude-code-session-id" in headers or "claude-cli" in ua or "claude-code" in ua:
        return classify_claude_code
    return classify_generic


def classify(
    conv: Conversation, headers: Mapping[str, str], agent_headers: tuple[str, ...]
) -> tuple[Role, str]:
    """(role, agent id) of a call."""
    return pick_classifier(headers, conv)(conv, headers, harness_agent_id(headers, agent_headers))
