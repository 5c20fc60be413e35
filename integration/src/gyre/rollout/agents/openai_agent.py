"""An example command-line agent on the official `openai` SDK (Chat Completions), for the command harness.

`python -m gyre.rollout.agents.openai_agent PROMPT`: a tool loop in the current directory with two file tools
(`read_file`, `write_file`, paths inside the directory only), at most $GYRE_TURNS calls of
$GYRE_MAX_TOKENS tokens at $GYRE_TEMPERATURE, to the endpoint the SDK reads from $OPENAI_BASE_URL (the
command harness points it at the execution's route on gyre-proxy's OpenAI front). The last reply's text
is printed on standard output (the final answer); progress goes to standard error. Exit status 0 when
the model answered, 1 when a call failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import openai

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "The text of a file in the working directory",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file in the working directory",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
]
SYSTEM = "You edit files in the working directory with read_file and write_file, then answer briefly."


def run_tool(name: str, arguments: str, root: Path) -> str:
    """A tool's output; bad input is an error text for the model, never an exception."""
    try:
        args = json.loads(arguments or "{}")
        path = (root / str(args.get("path", ""))).resolve()
        if not path.is_relative_to(root) or path == root:
            return "error: the path must name a file inside the working directory"
        if name == "read_file":
            return path.read_text()
        if name == "write_file":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(args.get("content", "")))
            return f"wrote {path.relative_to(root)}"
        return f"error: unknown tool {name!r}"
    except (OSError, ValueError, AttributeError) as exc:
        return f"error: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gyre.rollout.agents.openai_agent PROMPT", file=sys.stderr)
        return 2
    root = Path.cwd().resolve()
    turns = int(os.environ.get("GYRE_TURNS", "4"))
    max_tokens = int(os.environ.get("GYRE_MAX_TOKENS", "256"))
    temperature = float(os.environ.get("GYRE_TEMPERATURE", "1.0"))
    client = openai.OpenAI(max_retries=8, timeout=120.0)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": args[0]}]
    answer = ""
    for turn in range(turns):
        try:
            r = client.chat.completions.create(
                model="gyre-policy",
                messages=messages,
                tools=TOOLS,
                max_tokens=max_tokens,
                temperature=temperature,
            )
        except openai.OpenAIError as exc:
            print(f"call {turn} failed: {exc}", file=sys.stderr)
            print(answer)
            return 1
        msg = r.choices[0].message
        answer = msg.content or ""
        calls = msg.tool_calls or []
        print(f"call {turn}: {len(calls)} tool call(s), {len(answer)} characters", file=sys.stderr)
        if not calls:
            break
        messages.append(msg.model_dump(exclude_none=True))
        for tc in calls:
            fn = getattr(tc, "function", None)
            out = run_tool(fn.name, fn.arguments, root) if fn is not None else "error: not a function call"
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    print(answer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
