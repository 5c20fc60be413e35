"""Harness metadata that is not for the policy: rules that find it among system text blocks and take it out.

Claude Code 2.1.328 opens its system prompt with a text block of its own,
`x-anthropic-billing-header: cc_version=2.1.328.d9f; cc_entrypoint=sdk-cli;` (sub-agents add
`cc_is_subagent=true;`, and the version suffix changes across calls). Left in the prompt it makes a fork's
context differ from its parent's at the first tokens, so nothing after them is shared in the trajectory
tree or the engine's prefix cache. A `StripRule` is a regular expression that a whole system text block
must match; the blocks that match are removed from what the policy sees and kept, by rule name, for the
call's record metadata.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StripRule:
    name: str
    """Names the rule in the record's metadata (`stripped.<name>`)."""
    pattern: str
    """A regular expression that a whole system text block must match (`re.fullmatch`, DOTALL)."""


CLAUDE_CODE_BILLING = StripRule("claude-code-billing", r"x-anthropic-billing-header: [^\n]*\n?")
"""Claude Code's billing line (captured from 2.1.328's real traffic); on by default."""


class Stripper:
    """Applies rules to the system text blocks of one request at a time (stateless after construction)."""

    def __init__(self, rules: tuple[StripRule, ...]) -> None:
        self.rules = [(r.name, re.compile(r.pattern, re.DOTALL)) for r in rules]

    def split(self, blocks: list[str]) -> tuple[list[str], tuple[tuple[str, str], ...]]:
        """(the blocks the policy sees, (rule name, text) of each block removed), in order."""
        if not self.rules:
            return blocks, ()
        kept: list[str] = []
        gone: list[tuple[str, str]] = []
        for text in blocks:
            name = next((n for n, rx in self.rules if rx.fullmatch(text)), None)
            if name is None:
                kept.append(text)
            else:
                gone.append((name, text))
        return kept, tuple(gone)
