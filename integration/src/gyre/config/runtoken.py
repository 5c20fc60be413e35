"""The run token of a `gyre run`: one secret shared by every process and link of the run.

`install()` puts it in `$GYRE_TOKEN` of this process for as long as the run lasts: the token already
there (a run spread over hosts must share one) or else a new random one (`secrets.token_urlsafe`, 256
bits). Every child inherits it through its environment, and every link of the run reads it from there
(gyre-xfer `auth`: ZeroMQ CURVE for gyre-sched, the core's ROUTER, the weight publishers, the trajectory
service's PULL and the proxy's PUSH), so every link carries it even on loopback. `uninstall()` puts the
environment back as it was.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gyre_base.token import TOKEN_ENV, new_token


@dataclass
class RunToken:
    token: str = field(repr=False)
    previous: str | None = field(repr=False)

    @property
    def made(self) -> bool:
        """Whether `install` made the token (none was set), rather than keeping the one given."""
        return not (self.previous or "").strip()

    def uninstall(self) -> None:
        """Restore `$GYRE_TOKEN` to what it was before `install`."""
        if self.previous is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = self.previous


def install() -> RunToken:
    """Set `$GYRE_TOKEN` for the run (keeping one already set) and return how to undo it."""
    previous = os.environ.get(TOKEN_ENV)
    token = (previous or "").strip() or new_token()
    os.environ[TOKEN_ENV] = token
    return RunToken(token, previous)
