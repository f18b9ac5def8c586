"""A private event loop on a background thread, so synchronous callers (CLI, notebooks) can use async code.

`asyncio.run` fails inside a running loop (Jupyter has one), and the async generator clients
(httpx, the engine's queues) want one loop for their lifetime: this gives both.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs coroutines on a daemon thread's event loop."""

    def __init__(self, name: str = "rag-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine to completion and return its result (re-raises its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """Iterate an async iterator from synchronous code; closing the iterator closes it."""
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and self.loop.is_running():
                self.run(aclose())

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
