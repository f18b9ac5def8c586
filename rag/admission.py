"""Admission control: a bounded number of generations in flight and a bounded queue before them.

Past both bounds a request is refused at once (OverloadedError → HTTP 429 with Retry-After)
instead of waiting until its client times out. Waiters are served first come, first served.
Works from any event loop (the API's, the CLI's background loop): the counters are guarded by a
thread lock, and a waiter is woken on its own loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from rag.errors import OverloadedError


@dataclass(frozen=True)
class AdmissionSnapshot:
    in_flight: int
    queued: int
    max_in_flight: int
    max_queued: int
    num_admitted: int
    num_rejected: int


class AdmissionControl:
    """Slots for generations.

    Args:
        max_in_flight: generations running at once (>= 1).
        max_queued: requests that may wait for a slot (>= 0); past that, OverloadedError.
    """

    def __init__(self, max_in_flight: int, max_queued: int) -> None:
        if max_in_flight < 1 or max_queued < 0:
            raise ValueError(f"need max_in_flight >= 1 and max_queued >= 0, got {max_in_flight}, {max_queued}")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self._lock = threading.Lock()
        self._in_flight = 0
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()
        self._num_admitted = 0
        self._num_rejected = 0
        # Recent slot hold times, to tell a refused client when to come back.
        self._durations: deque[float] = deque(maxlen=64)

    def snapshot(self) -> AdmissionSnapshot:
        with self._lock:
            return AdmissionSnapshot(self._in_flight, len(self._waiters), self.max_in_flight, self.max_queued,
                                     self._num_admitted, self._num_rejected)

    def check(self) -> None:
        """Refuse now, before any retrieval work, when every slot and queue place is taken.

        Only a fast path: a request that passes may still be refused when it asks for its slot.

        Raises:
            OverloadedError: the queue is full.
        """
        with self._lock:
            if self._in_flight >= self.max_in_flight and len(self._waiters) >= self.max_queued:
                self._num_rejected += 1
                retry = self._retry_after_locked()
                raise OverloadedError(f"the service is busy: retry in {retry:.0f} s", retry_after=retry)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a generation slot; yields the seconds spent waiting for it.

        Raises:
            OverloadedError: every slot is taken and the queue is full.
        """
        started = time.perf_counter()
        await self._acquire()
        waited = time.perf_counter() - started
        held = time.perf_counter()
        try:
            yield waited
        finally:
            self._release(time.perf_counter() - held)

    async def _acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._in_flight < self.max_in_flight and not self._waiters:
                self._in_flight += 1
                self._num_admitted += 1
                return
            if len(self._waiters) >= self.max_queued:
                self._num_rejected += 1
                retry = self._retry_after_locked()
                raise OverloadedError(
                    f"the service is busy ({self._in_flight} answers being generated, {len(self._waiters)} "
                    f"waiting): retry in {retry:.0f} s", retry_after=retry)
            future: asyncio.Future[None] = loop.create_future()
            waiter = (loop, future)
            self._waiters.append(waiter)
        try:
            await future
        except BaseException:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    raise
            # The slot was handed to us just as we were cancelled: pass it on.
            self._release(None)
            raise

    def _release(self, held: float | None) -> None:
        with self._lock:
            if held is not None:
                self._durations.append(held)
            while self._waiters:
                loop, future = self._waiters.popleft()
                # The slot moves to the waiter directly (in_flight unchanged), so nobody jumps the queue.
                self._num_admitted += 1
                try:
                    loop.call_soon_threadsafe(_wake, future)
                except RuntimeError:  # that waiter's loop is closed: try the next
                    self._num_admitted -= 1
                    continue
                return
            self._in_flight -= 1

    def _retry_after_locked(self) -> float:
        typical = sorted(self._durations)[len(self._durations) // 2] if self._durations else 1.0
        # A slot frees every typical/max_in_flight seconds; the queue ahead must drain first.
        wait = typical * (len(self._waiters) + 1) / self.max_in_flight
        return float(min(60, max(1, round(wait))))


def _wake(future: asyncio.Future[None]) -> None:
    # A cancelled waiter is not woken: its owner sees it has left the queue and hands the slot on.
    if not future.done():
        future.set_result(None)
