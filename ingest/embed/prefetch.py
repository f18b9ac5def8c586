"""Run an iterator ahead of its consumer in a background thread, a bounded number of items ahead."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


def prefetch(items: Iterable[T], depth: int) -> Iterator[T]:
    """Yield the items of `items`, produced by a background thread up to `depth` items ahead.

    Pays off when producing an item mostly waits outside the GIL (the Rust tokenizer, pinned-memory
    copies) while the consumer drives a device. An exception in the producer is raised in the
    consumer at the item where it happened; a consumer that stops early stops the producer.
    """
    assert depth >= 1
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        # A timeout, not a plain blocking put, so a consumer that has gone away cannot strand us.
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def fill() -> None:
        source = iter(items)
        try:
            for item in source:
                if not put((item, None)):
                    return
            put((_DONE, None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            put((_DONE, e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a generator source stops its own helpers (nested prefetch)
                close()

    thread = threading.Thread(target=fill, name="embed-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = slots.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
