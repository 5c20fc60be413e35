"""What one agent's last call looked like, to check the next call of that agent against it.

When the harness only appended to an agent's last request (the same system and tools, every earlier turn
unchanged, then an assistant turn: the reply it got), the new input must start with that call's exact
input + output. Such a call is marked `extends` in its record, and a call whose input does not extend is
counted (a non-extension: a reuse the proxy missed). An empty reply cannot be sent back through
Anthropic's API (it refuses empty content), so harnesses drop it; when the agent's last output was empty
and the new request continues that conversation with no assistant turn in its place, the empty turn is
put back where the policy produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre_proxy.chat import Conversation, Kind, Turn


@dataclass
class LastCall:
    call_id: str
    system: str
    tools_json: tuple[str, ...]
    turns: tuple[Turn, ...]
    full: np.ndarray  # input + output ids
    empty: bool  # the reply had no content at all

    @classmethod
    def of(cls, call_id: str, conv: Conversation, full: np.ndarray, empty: bool) -> LastCall:
        return cls(call_id, conv.system, conv.tools_json, conv.turns, full, empty)

    def _continues(self, conv: Conversation) -> bool:
        n = len(self.turns)
        return (
            len(conv.turns) > n
            and conv.system == self.system
            and conv.tools_json == self.tools_json
            and conv.turns[:n] == self.turns
        )

    def restore_empty_reply(self, conv: Conversation) -> Conversation | None:
        """`conv` with the dropped empty reply put back, if that is what happened (else None)."""
        n = len(self.turns)
        if not self.empty or not self._continues(conv) or conv.turns[n].kind is Kind.ASSISTANT:
            return None
        turns = (*conv.turns[:n], Turn(Kind.ASSISTANT), *conv.turns[n:])
        return Conversation(conv.system, conv.tools_json, turns, conv.thinking, conv.stripped)

    def only_appended(self, conv: Conversation) -> bool:
        """Whether `conv` is this call's conversation, its reply, and more."""
        return self._continues(conv) and conv.turns[len(self.turns)].kind is Kind.ASSISTANT

    def extended_by(self, input_ids: np.ndarray) -> bool:
        """Whether `input_ids` starts with this call's input + output."""
        n = self.full.size
        return input_ids.size >= n and bool(np.array_equal(input_ids[:n], self.full))
