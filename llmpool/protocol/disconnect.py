"""Racing a client's disconnect: work done for a client stops when the client goes away.

An ASGI server tells a handler that its client left only through ``receive``, and only when
asked; a watcher task asks for the whole wait, and work raced against it is cancelled (and so
closes what it holds: the engine's request, the upstream connection) as soon as the client is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the work done for it ended: nobody is left to answer."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def disconnect_watcher(receive: Receive) -> AsyncIterator[asyncio.Future[None]]:
    """A future done once the client disconnects, watched while the block runs."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        yield watcher
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def unless_gone(work: Awaitable[T], gone: asyncio.Future[None]) -> T:
    """``work``'s result, or ClientGone once ``gone`` (a ``disconnect_watcher``) is done first.

    Work left unfinished, whatever the reason (the client left, or the caller was cancelled), is
    cancelled and waited for, so it has let go of what it holds when this returns.
    """
    task = asyncio.ensure_future(work)
    waiting: set[asyncio.Future[Any]] = {task, gone}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()
