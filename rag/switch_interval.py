"""A shorter GIL switch interval while a thread that launches many short GPU ops shares the process.

CPython hands the GIL to a waiting thread only when the holder releases it or, at the latest, after
`sys.getswitchinterval()` (5 ms by default). An embedder thread on a GPU releases the GIL inside
each torch op (a launch, ~10-20 µs) and needs it back before the next: beside a thread that runs
Python (the ingest's chunking and catalog writes), each of its hundreds of ops per forward can wait
up to the whole interval for it (the convoy effect; bench/gil_switch.py measures it). A shorter
interval bounds that wait, at the price of more hand-overs for the Python thread while the other
one waits.

The interval is process-wide, so holders are counted: it stays lowered while any holder is active
and the value found before the first is restored after the last.
"""

from __future__ import annotations

import sys
import threading

# The ingest's default (setting ingest_switch_interval_ms). On the dev CPU (bench/gil_switch.py), a
# thread of short ops beside a Python thread that never lets go ran 560x slower than alone at the
# default 5 ms and 13x at 0.1 ms; the Python thread then ran at 0.6 of its speed. On an H100 ingest
# of 50,000 records (bench/ingest_gpu.py --switch-ms 0 0.1) the overlapped embed stage went from 0.49x
# to 0.67x of the embedder alone and the run from 24.9 to 19.7 s (docs/benchmarks.md).
OVERLAP_SWITCH_INTERVAL_MS = 0.1

_lock = threading.Lock()
_holders = 0
_saved: float | None = None


def acquire_shorter(milliseconds: float = OVERLAP_SWITCH_INTERVAL_MS) -> None:
    """Lower the switch interval to `milliseconds` (never raise it); pair with `release_shorter`."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = sys.getswitchinterval()
        _holders += 1
        if milliseconds / 1000.0 < sys.getswitchinterval():
            sys.setswitchinterval(milliseconds / 1000.0)


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
