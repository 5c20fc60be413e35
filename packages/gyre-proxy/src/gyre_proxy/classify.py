"""Per-harness classifiers: which agent loop made a call (main, main_summary, subagent, subagent_summary).

Claude Code sends every loop of one session under one `X-Claude-Code-Session-Id`; they differ in the
system prompt (2.1.328, read from its real traffic: sub-agents carry `cc_is_subagent=true` in the first
system block and "You are an agent for Claude Code"; the main loop says "You are Claude Code" when
interactive and "You are a Claude agent, built on Anthropic's Claude Agent SDK" under `-p`) and in the last
user turn (compaction asks for "a detailed summary of the conversation"). The agent id names the loop: the main loop is "main", others a short hash
of their system prompt and first user turn, so parallel sub-agents stay apart.
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
    def __call__(self, conv: Conversation, headers: Mapping[str, str]) -> tuple[Role, str]: ...


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


def classify_claude_code(conv: Conversation, headers: Mapping[str, str]) -> tuple[Role, str]:
    """Claude Code: main loop by its system prompt; anything else with tools is a sub-agent."""
    system = conv.system
    main = any(m in system for m in CC_MAIN_MARKERS) and not any(m in system for m in CC_SUB_MARKERS)
    summary = is_summary(conv)
    if main:
        return (Role.MAIN_SUMMARY if summary else Role.MAIN), "main"
    agent = "sub-" + _digest(system, _first_user_text(conv))
    return (Role.SUBAGENT_SUMMARY if summary else Role.SUBAGENT), agent


def classify_generic(conv: Conversation, headers: Mapping[str, str]) -> tuple[Role, str]:
    """Any other harness: one main loop per execution, unless it names its agent in `X-Gyre-Agent`
    (`main` or anything else for a sub-agent) and its role in `X-Gyre-Role`."""
    agent = headers.get("x-gyre-agent", "main")
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
