"""Server-sent events for OpenAI streams, and a response that aborts its generation when the client leaves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from rag.api.streaming import EventStream  # noqa: F401 - the SSE response both servers use

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One `data: {...}` event (compact JSON, as OpenAI sends it)."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine request) if the client disconnects.

    Raises:
        ClientDisconnected: the client left first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # we were cancelled (shutdown): the work must not outlive us
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with anyio.CancelScope(shield=True):
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - nobody is waiting for its result
            pass
    raise ClientDisconnected()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server gives is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
