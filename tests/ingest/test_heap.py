"""fix_mmap_threshold: set through glibc's mallopt where there is one, and never against the user's choice."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ingest.heap import fix_mmap_threshold

CHILD = """
import ctypes, sys
from ingest.heap import fix_mmap_threshold
print(fix_mmap_threshold() if sys.argv[1] == "fix" else "unset")
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
# What an embedder does: free a big buffer (glibc then raises its mmap threshold), then keep
# allocating big buffers between small long-lived objects and freeing them.
libc.free(libc.malloc(3 << 20))
before = rss()
big, small = [], []
for _ in range(64):
    big.append(libc.malloc(3 << 20))
    ctypes.memset(big[-1], 1, 3 << 20)
    small.append(libc.malloc(256 << 10))  # long-lived, and placed after the buffer: pins the hole
for p in big:
    libc.free(p)
print(rss() - before)
"""


def _resident_after_free(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout
    flag, kib = out.split()
    return flag, int(kib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_fixed_threshold_returns_big_freed_buffers_to_the_os():
    flag, kept = _resident_after_free("fix")
    assert flag == "True"
    assert kept < 32 * 1024  # KiB still resident after freeing 192 MiB
    # Without it the freed buffers stay resident (the drift the fix is for).
    _, kept_default = _resident_after_free("default")
    assert kept_default > 128 * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_mmap_threshold() is False
