"""Work done for a client only while that client is there.

`while_connected(request, work)` runs `work` (a call's generation and record) and watches the client's
connection at the same time: if the client disconnects first, `work` is cancelled, which aborts the
call's engine request (`/abort_request` with its rid, see `generation.py`) and records nothing, and
`ClientLeft` is raised. Streams need no watcher: Starlette cancels a streaming response whose client
went away, with the same effect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request

from gyre_proxy.errors import ClientLeft


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the request body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def while_connected[T](request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`await work` in this task, unless the client leaves first: then this task is cancelled (which
    cancels `work`) and `ClientLeft` raised. Only the watcher is a task of its own, so the work takes no
    extra turn of the event loop to start or to be waited for."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        await _disconnected(request)
        left = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise  # cancelled from elsewhere (the server is stopping)
        task.uncancel()
        raise ClientLeft(
            "the client disconnected before its answer was ready; its engine work was aborted"
        ) from None
    finally:
        # not waited for: it ends at the loop's next turn (one turn less per call under load)
        watcher.cancel()
        watcher.add_done_callback(_retrieved)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: nobody waits for it any more
