"""A shorter GIL switch interval while a thread that launches many short GPU ops shares the process.

CPython hands the GIL to a waiting thread only when the holder releases it or, at the latest, after
`sys.getswitchinterval()` (5 ms by default). An embedder thread on a GPU releases the GIL inside
each torch op (a launch, ~10-20 µs) and needs it back before the next: beside a thread that runs
Python (the ingest's chunking and catalog writes), each of its hundreds of ops per forward can wait
up to the whole interval for it (the convoy effect; bench/gil_switch.py measures it). A shorter
interval bounds that wait; the Python thread loses only the cost of the extra hand-overs, and only
while the other thread actually waits.

The interval is process-wide, so `shorter_switch_interval` is counted: it stays lowered while any
holder is active and the value found before the first is restored after the last.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# 0.1 ms: at the default 5 ms a thread of short ops beside a busy Python thread ran ~500x slower
# than alone on the dev machine; at 0.1 ms ~14x (bench/gil_switch.py), while the Python thread kept
# most of its speed.
OVERLAP_SWITCH_INTERVAL = 1e-4

_lock = threading.Lock()
_holders = 0
_saved: float | None = None


@contextmanager
def shorter_switch_interval(seconds: float = OVERLAP_SWITCH_INTERVAL) -> Iterator[None]:
    """Lower the interpreter's switch interval to `seconds` (never raise it) while inside."""
    acquire_shorter(seconds)
    try:
        yield
    finally:
        release_shorter()


def acquire_shorter(seconds: float = OVERLAP_SWITCH_INTERVAL) -> None:
    """As entering `shorter_switch_interval`; pair every call with `release_shorter`."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = sys.getswitchinterval()
        _holders += 1
        if seconds < sys.getswitchinterval():
            sys.setswitchinterval(seconds)


def release_shorter() -> None:
    """Undo one `acquire_shorter`; the last one restores the interval found before the first."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _saved is not None:
            sys.setswitchinterval(_saved)
            _saved = None
