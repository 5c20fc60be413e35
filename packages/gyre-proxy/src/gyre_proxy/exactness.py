"""What one agent's last call looked like, to check the next call of that agent against it.

When the harness only appended to an agent's last request (the same system and tools, every earlier turn
unchanged, then an assistant turn: the reply it got), the new input must start with that call's exact
input + output. Such a call is marked `extends` in its record, and a call whose input does not extend is
counted (a non-extension: a reuse the proxy missed). An empty reply cannot be sent back through
Anthropic's API (it refuses empty content), so harnesses leave it out; when the agent's last output was
empty and the new request continues that conversation with no assistant turn in its place, the empty
turn is put back where the policy produced it, and again in every later request that keeps the same
history.
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
    sent: tuple[Turn, ...]  # the turns as the harness sent them
    turns: tuple[Turn, ...]  # as rendered: `sent` with the empty replies it left out put back
    full: np.ndarray  # input + output ids
    empty: bool  # the reply had no content at all

    def restore(self, conv: Conversation) -> tuple[Conversation, int]:
        """`conv` as this agent's conversation really went (the empty replies the harness left out put
        back), and how many of them are new in this request. Unchanged if it does not continue it."""
        n = len(self.sent)
        if not (
            len(conv.turns) > n
            and conv.system == self.system
            and conv.tools_json == self.tools_json
            and conv.turns[:n] == self.sent
        ):
            return conv, 0
        rest = conv.turns[n:]
        new = 0
        if self.empty and rest[0].kind is not Kind.ASSISTANT:
            rest = (Turn(Kind.ASSISTANT), *rest)
            new = 1
        # the earlier turns are this call's own objects: later comparisons of them stop at identity
        turns = (*self.turns, *rest)
        return Conversation(self.system, self.tools_json, turns, conv.thinking, conv.stripped), new

    def only_appended(self, conv: Conversation) -> bool:
        """Whether `conv` (restored) is this call's conversation, its reply, and more."""
        n = len(self.turns)
        return (
            len(conv.turns) > n
            and conv.turns[n].kind is Kind.ASSISTANT
            and conv.system == self.system
            and conv.tools_json == self.tools_json
            and conv.turns[:n] == self.turns
        )

    def extended_by(self, input_ids: np.ndarray) -> bool:
        """Whether `input_ids` starts with this call's input + output."""
        n = self.full.size
        return input_ids.size >= n and bool(np.array_equal(input_ids[:n], self.full))
