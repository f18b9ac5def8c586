"""Server-sent events for OpenAI streams, and a response that aborts its generation when the client leaves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One `data: {...}` event (compact JSON, as OpenAI sends it)."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """An SSE response whose body generator is always closed, so its engine request is aborted.

    Starlette cancels the sending task when the client disconnects; if that happens while the task
    waits in `send`, the body generator stays suspended at a `yield` and would hold its engine
    request (and KV blocks) until the garbage collector finalises it. Closing it here frees them now.
    It also listens for the disconnect itself, whatever ASGI spec version the server reports.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the connection is gone; the finally below aborts the generation
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()


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
