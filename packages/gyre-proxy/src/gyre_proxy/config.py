"""The proxy's settings, declared once: `ProxyConfig` is what the code reads and what `gyre-proxy serve`'s
flags are derived from (each field's docstring is its help).

The listener rule sits with the settings it governs and is checked on construction: the HTTP listener
binds 127.0.0.1 unless `allow_remote`, and a listener beyond loopback needs per-execution API keys (every
call then carries a key that binds its execution). The ZeroMQ sockets (control DEALER, record PUSH) use
the run token (`token`, else `$GYRE_TOKEN`) through `gyre_base.token`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gyre_base.token import TokenError, read_token_file

from gyre_proxy.flags import flag
from gyre_proxy.strip import CLAUDE_CODE_BILLING, StripRule

KEEP_ALIVE_S = 75
"""How long the server keeps an idle client connection open. Longer than HTTP clients keep theirs in
their pools (httpx and the official SDKs: 5 s), so the client lets go first: a server that closes a
kept-alive connection as a client sends a request on it (uvicorn's default is 5 s too, and a busy event
loop runs the close late) makes that request fail with a reset, not an answer."""


class ConfigError(ValueError):
    """A setting (or a combination of settings) the proxy refuses to run with."""


def is_loopback_host(host: str) -> bool:
    """Whether an HTTP listen address stays on this machine (a loopback IP or "localhost")."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def load_api_keys(path: str) -> dict[str, str]:
    """`{"key": "execution", ...}` from a JSON file (for `--api-keys`)."""
    try:
        with open(path) as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read API keys from {path}: {exc}") from None
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise argparse.ArgumentTypeError(f"{path}: expected a JSON object of key -> execution id strings")
    return dict(raw)


def parse_strip_rule(text: str) -> StripRule:
    """`NAME=REGEX` (for `--strip-rule`)."""
    name, eq, pattern = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=REGEX, got {text!r}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"strip rule {name}: bad regular expression: {exc}") from None
    return StripRule(name, pattern)


def parse_token_file(path: str) -> str:
    try:
        return read_token_file(path)
    except TokenError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


KV_TRANSPORTS = ("shm", "mooncake", "http", "cuda_ipc")
"""Ways a cached prefix goes from one engine to another (`kvmove.py`)."""


@dataclass
class ProxyConfig:
    """Everything the proxy needs; `gyre-proxy serve` takes one flag per field."""

    tokenizer: str
    """Path to a tokenizer.json, or a model directory holding one (the policy's tokenizer)."""
    model_name: str = "gyre-policy"
    """Model id reported by /v1/models and echoed in responses (any requested model name is accepted)."""
    engines: tuple[str, ...] = field(default=(), metadata=flag("--engine", metavar="URL"))
    """Engine URLs routed to from the start (ids 0, 1, ...); more come from the scheduler at run time."""
    record_log: str = ""
    """Append-only msgpack TITO log (gyre-traj framed stream), fsynced before each response completes."""
    record_push: str = ""
    """ZeroMQ endpoint of the trajectory service's PULL socket (records are PUSHed there); empty: none."""
    api_keys: Mapping[str, str] = field(
        default_factory=dict,
        repr=False,
        metadata=flag(parse=load_api_keys, metavar="FILE", help="On the command line: a JSON file."),
    )
    """Per-execution API keys (key -> execution id). When non-empty every call needs one of them (any other
    key is a 401), the key's execution is the call's (a path or header naming another execution is a
    403), and /gyre/stats needs a key too."""
    max_context_tokens: int = field(default=40960, metadata=flag("--max-context"))
    """Input tokens beyond this are answered 413; max_new_tokens is clipped to what is left."""
    max_body_bytes: int = 32 * 1024 * 1024
    """The longest request body taken, in bytes (Anthropic's API takes 32 MB); a longer one is answered
    413 in the API's error shape as soon as that is known, before any of it is parsed or buffered whole."""
    decoded_cache_bytes: int = 64 * 1024 * 1024
    """Request messages kept decoded, by their exact bytes, in bytes of JSON (least recently used first to
    go): the history a harness sends again on each call is then decoded and checked once."""
    decoded_bodies_bytes: int = 256 * 1024 * 1024
    """Request bodies kept with their decoded messages (the most recent few of each execution), in bytes
    (least recently used execution first to go): a request that resends one's messages plus new ones has
    only the new ones decoded and checked."""
    max_new_tokens_cap: int = 32768
    """The most new tokens one call may ask for (a larger max_tokens is clipped)."""
    drain_grace_s: float = field(default=0.0, metadata=flag("--drain-grace"))
    """How long a drained engine may finish its in-flight calls before they move to another engine."""
    pick_wait_s: float = field(default=5.0, metadata=flag("--pick-wait"))
    """How long a call waits for an engine to take it before the harness gets 529/503 (it retries)."""
    kv_transport: str = "shm"
    """How a call's cached prefix (KV) goes along when its execution moves to another engine (a drain, a
    rebalance): shm (gyre-xfer over shared memory, engines on one host), mooncake (gyre-xfer over Mooncake
    Transfer Engine, across hosts), http (the KV in HTTP bodies) or cuda_ipc (device to device between
    gyre-engines on one GPU; an engine off CUDA, or short of free GPU memory, offers over shared memory
    instead, and an engine on another GPU refuses it: that call is prefilled again). Whatever does not
    arrive, the next engine prefills again."""
    session_idle_s: float = 30.0
    """An execution with a call in the last this-many seconds is live on its engine; between two calls
    an execution moves to the engine with the fewest live executions when its own has at least two more
    (an engine that joins, or comes back from training, gets its share). 0: executions never move but
    for a drain or a failure."""
    request_timeout_s: float = 600.0
    """Longest wait on an engine's answer (connect: 5 s)."""
    stream_interval: int = 4
    """Engine streaming chunk interval in tokens."""
    max_executions: int = 1024
    """Executions whose render caches are kept (least recently used first to go). A 500k-token execution
    keeps about 10 MB (ids, their JSON text, the last request's turns); one whose cache went is
    re-tokenized on its next call, except its recorded outputs, which are kept for 16x as many executions."""
    incremental: bool = True
    """Reuse earlier segments and recorded ids. False re-renders and re-tokenizes the whole prompt each
    call (the naive way, for comparison in the benchmark; earlier outputs are then NOT kept exact)."""
    agent_headers: tuple[str, ...] = field(
        default=("x-claude-code-agent-id", "x-gyre-agent"), metadata=flag("--agent-header", metavar="HEADER")
    )
    """Request headers (lower case) that carry the harness's own agent id, first present wins; without
    one the agent id is guessed (Claude Code: "main" or a hash of the system prompt and first user turn)."""
    strip_rules: tuple[StripRule, ...] = field(
        default=(CLAUDE_CODE_BILLING,),
        metadata=flag("--strip-rule", parse=parse_strip_rule, metavar="NAME=REGEX"),
    )
    """System text blocks removed from what the policy sees (harness metadata, a block matching REGEX
    whole), kept in the record's metadata as `stripped.<rule name>`."""
    engine_retry_s: float = 0.2
    """First wait before the health check of an engine a connection to failed (doubling each time)."""
    engine_retry_max_s: float = 5.0
    """Longest wait between health checks of a failed engine."""
    host: str = "127.0.0.1"
    """HTTP listen address. Beyond loopback only with `allow_remote` and per-execution API keys."""
    port: int = 8080
    """HTTP listen port."""
    allow_remote: bool = False
    """Allow a listen address beyond loopback (API keys are then required as well)."""
    sched: str = ""
    """gyre-sched endpoint (engines are added, drained and removed from there); empty: none."""
    token: str = field(
        default="",
        repr=False,
        metadata=flag("--token-file", parse=parse_token_file, metavar="FILE", help="On the command line: "
                      "a file whose first line is the token (kept out of `ps`)."),
    )  # fmt: skip
    """The run token for the ZeroMQ sockets (control DEALER, record PUSH: CURVE keys derived from it);
    empty reads $GYRE_TOKEN; none at all only reaches peers that take no token (loopback)."""

    def __post_init__(self) -> None:
        self.engines = tuple(self.engines)
        self.agent_headers = tuple(h.lower() for h in self.agent_headers)
        self.strip_rules = tuple(self.strip_rules)
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be at least 1, got {self.max_body_bytes}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError(
                f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}"
            )
        if self.session_idle_s < 0:
            raise ConfigError(f"session_idle_s must be >= 0, got {self.session_idle_s}")
        if not is_loopback_host(self.host):
            if not self.allow_remote:
                raise ConfigError(
                    f"refusing to listen on {self.host}: not loopback (allow_remote / --allow-remote)"
                )
            if not self.api_keys:
                raise ConfigError(
                    f"refusing to listen on {self.host} beyond loopback without per-execution API keys "
                    "(api_keys / --api-keys): anyone who reaches it could write training data"
                )
