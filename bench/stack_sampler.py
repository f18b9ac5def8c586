"""A sampling profiler for a running server: where each thread's Python time goes, by function.

    RAG_BENCH_STACKS=/tmp/stacks.txt PYTHONPATH=. python bench/serve_load_server.py ...

`StackSampler` wakes every `interval` seconds, reads every thread's current frame
(`sys._current_frames`) and counts, per thread name, the innermost frames of our code and of the
libraries it calls. A thread waiting in a selector, a queue or a lock is counted as "(waiting)", so
the report tells busy time from idle time, which cProfile (one thread, and its own overhead on every
call) cannot. The report is rewritten every `dump_every` seconds, so a server killed at the end of a
load run still leaves one. A thread inside C code (uvloop's event loop, a torch op) shows its
last Python frame: uvloop's idle and busy time both read as `runners.py:run`. Sampling holds
the GIL for a few microseconds per wake: at the default 5 ms that is well under 1% of a core.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

# Leaf functions that mean "this thread is not running Python": blocked in the OS or on another thread.
_WAITING = {"select", "poll", "epoll", "wait", "_wait", "acquire", "get", "sleep", "accept", "recv", "recv_into",
            "read", "readinto", "_recv_into", "join", "_worker", "run_forever"}  # fmt: skip


def _frames_label(frame, depth: int) -> tuple[str, str]:
    """(leaf function, the innermost `depth` frames as 'file:function' joined by ' < ')."""
    parts = []
    leaf = frame.f_code.co_name
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{Path(code.co_filename).name}:{code.co_name}")
        frame = frame.f_back
    return leaf, " < ".join(parts)


class StackSampler:
    """Counts (thread, stack) samples on a daemon thread; `report()` renders them."""

    def __init__(self, out: Path, interval: float = 0.005, depth: int = 6, dump_every: float = 5.0) -> None:
        self.out, self.interval, self.depth, self.dump_every = out, interval, depth, dump_every
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.per_thread: collections.Counter[str] = collections.Counter()
        self.busy: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        last_dump = time.monotonic()
        while True:
            time.sleep(self.interval)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                if name.startswith(("ThreadPoolExecutor", "AnyIO worker", "asyncio_", "uvloop_")):
                    name = "worker threads"
                leaf, stack = _frames_label(frame, self.depth)
                self.per_thread[name] += 1
                if leaf in _WAITING:
                    stack = "(waiting)"
                else:
                    self.busy[name] += 1
                self.counts[(name, stack)] += 1
            if time.monotonic() - last_dump > self.dump_every:
                last_dump = time.monotonic()
                self.out.write_text(self.report())

    def report(self, top: int = 25) -> str:
        lines = []
        for name, total in self.per_thread.most_common():
            busy = self.busy[name]
            lines.append(f"## {name}: {total} samples, busy {busy} ({100 * busy / max(1, total):.0f}%)")
            rows = [(stack, n) for (thread, stack), n in self.counts.items() if thread == name]
            for stack, n in sorted(rows, key=lambda r: -r[1])[:top]:
                lines.append(f"{100 * n / max(1, total):5.1f}%  {stack}")
            lines.append("")
        return "\n".join(lines)


def start_from_env(variable: str = "RAG_BENCH_STACKS") -> StackSampler | None:
    """Start a sampler writing to the file the variable names; None when it is unset."""
    out = os.environ.get(variable)
    return StackSampler(Path(out)).start() if out else None
