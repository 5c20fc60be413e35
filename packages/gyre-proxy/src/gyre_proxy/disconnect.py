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
    """`await work`, unless the client leaves first: then `work` is cancelled and `ClientLeft` raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        # not waited for: it ends at the loop's next turn (one turn less per call under load)
        watch.cancel()
        watch.add_done_callback(_retrieved)
    if task.done() and not task.cancelled():
        return task.result()
    await _settle(task)
    raise ClientLeft("the client disconnected before its answer was ready; its engine work was aborted")


async def _settle(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and wait until it has ended, whatever it ends with."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: nobody waits for it any more


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: nobody waits for it any more
