"""Server-sent events and client disconnects.

`until_disconnected` wraps a route's event stream so that a client who goes away stops the work
at once (the generator's stream is closed, which aborts the engine request and frees its KV
blocks), whether it left while queued, waiting for its first token, or mid-answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """An SSE response whose body generator is always closed, so its engine request is aborted.

    Starlette cancels the sending task when the client disconnects; if that happens while the task
    waits in `send`, the body generator stays suspended at a `yield` and would hold its engine
    request (and KV blocks) until the garbage collector finalises it. Closing it here frees them now.
    It also listens for the disconnect itself, whatever ASGI spec version the server reports.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
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


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event; `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


async def until_disconnected(request: Request, events: AsyncIterator[T], poll: float = 0.25) -> AsyncIterator[T]:
    """The items of `events` until it ends or the client disconnects (then `events` is closed)."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        iterator = events.__aiter__()
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            try:
                while True:
                    done, _ = await asyncio.wait({step}, timeout=poll)
                    if done:
                        break
                    if await request.is_disconnected():
                        step.cancel()
                        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                            await step
                        return
            except BaseException:
                step.cancel()
                with contextlib.suppress(BaseException):
                    await step
                raise
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item


async def after_admission(first: Any, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """The answer's events once its slot is granted: `first` (read before the headers) then the rest,
    without the Admitted marker."""
    from rag.answering import Admitted

    if first is not None and not isinstance(first, Admitted):
        yield first
    async for event in events:
        if not isinstance(event, Admitted):
            yield event
