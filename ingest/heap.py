"""Keep a long ingest's resident memory flat: hand large freed buffers back to the OS.

The embedder allocates and frees activation buffers of varying size for every batch (tens of
MB on the CPU). glibc's malloc raises its mmap threshold each time such a buffer is freed, so
later ones come from the heap instead, whose freed holes RSS keeps: measured on 10,000 small
documents, the median RSS drifted from 904 to 989 MiB over the run and peaked at 1,146 MiB.
Fixing the threshold (which also stops the dynamic adjustment) keeps big buffers mmapped and
returned on free: median flat at ~770 MiB, peak 887 MiB (bench/ingest_memory.py, docs/benchmarks.md);
50,000 documents peak at 990 MiB against 868 MiB for 1,000. The price: each large buffer is a
fresh mmap to fault in, ~10% slower CPU embedding in an A/B. A malloc_trim(0) after each batch
instead cost nothing measurable but left more growth (1,037 -> 1,133 MiB from 1k to 20k documents).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
DEFAULT_THRESHOLD = 1 << 20


def fix_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Set glibc's malloc mmap threshold to `threshold` bytes for this process; True if set.

    A no-op (False) off Linux/glibc, and when MALLOC_MMAP_THRESHOLD_ is in the environment
    (the user chose). Call once at start, before the big allocations.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold))
    log.debug("malloc mmap threshold %s to %d bytes", "set" if ok else "not set", threshold)
    return ok
