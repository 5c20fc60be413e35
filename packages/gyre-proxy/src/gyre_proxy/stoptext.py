"""The text a client is shown of an output that may run into one of its stop sequences.

SGLang (and the Anthropic and OpenAI APIs) never put a matched stop string in the reply's text, while the
proxy asks the engine for `no_stop_trim` (the recorded ids must be exact, stop string included). So the
text ends before the first stop sequence in it, and while streaming, a tail that could still grow into a
stop sequence is held back until the next chunk says whether it does (even past a stop sequence already
in the text: a longer one may start earlier). So the shown text only ever grows (each later result
extends each earlier one), and the final one extends every streamed one.
"""

from __future__ import annotations

from collections.abc import Sequence


def shown_text(text: str, stops: Sequence[str], final: bool) -> str:
    """`text` cut before its first stop sequence; unless `final`, also before a tail that is the start of
    a stop sequence (shown once later text rules that out, never if it completes one)."""
    stops = [s for s in stops if s]
    if not stops:
        return text
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    if not final:
        cut = min(cut, len(text) - _held(text, stops))
    return text[:cut]


def _held(text: str, stops: Sequence[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of a stop sequence."""
    for k in range(min(len(text), max(len(s) for s in stops) - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0
