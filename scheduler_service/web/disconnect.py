"""Noticing a client that hangs up while its request waits for a pool.

Once a request's body is read, the next ASGI ``receive`` returns only when the
client disconnects (``http.disconnect``). ``DisconnectWatch`` (the runtime's
``ClientWatch`` over ASGI) races a wait against it, so a request whose client
left stops waiting (a pool task still queued is dropped) and ends as
``ClientDisconnectedError``: logged and counted as 499, not as a server error.
Inline work is never raced: it does not wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Message

from scheduler_service.runtime.errors import ClientDisconnectedError

__all__ = ["DisconnectWatch"]

T = TypeVar("T")


class DisconnectWatch:
    def __init__(self, receive: Callable[[], Awaitable[Message]]) -> None:
        self._receive = receive

    async def until_gone(self, work: Awaitable[T]) -> T:
        """``work``'s result, unless the client hangs up first: then ``work`` is cancelled."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(self._receive())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and watcher.result()["type"] == "http.disconnect":
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientDisconnectedError()
            return await task
        finally:
            watcher.cancel()
