"""Who may listen where: the rule `gyre-engine serve` checks before anything heavy is imported or loaded.
A host beyond loopback needs `allow_remote` and a token (the `token` setting, `--token-file`, or
`$GYRE_TOKEN`), because the control endpoints can replace the weights; a refusal exits with status 2
naming the setting, in the time it takes to parse the command line."""

from __future__ import annotations

import sys
from typing import NoReturn

from gyre_base.token import TokenError, is_loopback_host, listener_token


def listen_token(host: str, allow_remote: bool, token: str = "") -> str:
    """The token a listener on `host` runs with (`token`, else `$GYRE_TOKEN`); SystemExit(2) naming the
    setting if it may not start."""
    if not is_loopback_host(host) and not allow_remote:
        _refuse(f"refusing to bind {host}: the control endpoints replace weights; pass --allow-remote")
    try:
        return listener_token(host, token, "`gyre-engine serve --token-file FILE`")
    except TokenError as exc:
        _refuse(str(exc))


def _refuse(message: str) -> NoReturn:
    print(f"gyre-engine serve: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
