"""Parsing in worker processes: sources of the walk's window parsed at once, results in the walk's order.

PDF, DOCX and HTML parsing is pure Python (pdfminer, lxml, unstructured) and holds the GIL, so
one process parses one source at a time however many cores the job has. `ParsePool` hands whole
sources to `workers` processes. They are forked from a "forkserver" (never from the ingest process
itself: it holds torch and tokenizers threads, which a forked child would inherit in whatever state
they were), a fresh single-threaded process that imports and warms the parsers once
(`ingest.parse_forkserver`) before forking any worker: started cold with "spawn", each worker spent
its first ~10 s importing, all of them at once on the same cores, and on 16 cores a pool of 15
parsed 2,340 small sources slower than one process (docs/benchmarks.md). `start_forkserver()` starts
that server early (the ingest calls it before loading the embedder, so the warm-up runs beside the
model's load). Where there is no forkserver (Windows), workers are spawned as before. A source that
fails in a worker comes back as a `ParseFailure` carrying exactly the reason in-process parsing
would have reported, so problem lists do not depend on where a source was parsed.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ingest.parse import parse_item_stream
from ingest.sources import SourceItem
from rag.errors import IngestError
from rag.types import Document, Element

log = logging.getLogger(__name__)

# A source parsed ahead of its turn: its document and elements, or why it could not be parsed.
Parsed = tuple[Document, list[Element]] | Exception


class ParseFailure(IngestError):
    """A source that failed in a worker process; its message is the reason as reported in process."""


def failure_reason(e: BaseException) -> str:
    """What a run reports for a source whose parse raised `e` (the same wherever it was parsed)."""
    if isinstance(e, IngestError):
        return str(e)
    return f"{type(e).__name__}: {e}"  # a parser bug must not end the run; say what it was


def parse_whole(item: SourceItem, stream_above: int) -> Parsed:
    """`parse_item_stream` of a source parsed whole, its elements in a list; or the parse error."""
    try:
        doc, elements = parse_item_stream(item, stream_above)
        return doc, list(elements)
    except Exception as e:  # reported when the source's turn comes, as if it had been parsed then
        return e


PRELOAD = "ingest.parse_forkserver"


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, preloading the warm parsers; "spawn" where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    # Process-wide: the one forkserver of this process. It reads the list when it starts.
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


def start_forkserver() -> None:
    """Start the parse workers' forkserver now, so its warm-up overlaps the caller's own start-up.

    Returns at once: the server imports and warms the parsers in its own process, and the first
    worker fork waits for that. A no-op where there is no forkserver or it already runs.
    """
    ctx = _context()
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _exit_with_parent() -> None:
    """Worker initializer: end this process when the ingest process is gone (killed with SIGKILL, it
    cannot stop its workers, and a worker blocked on the task queue never sees the queue close).

    Watched through multiprocessing's parent sentinel, a pipe whose other end only the ingest
    process holds: it reads EOF the moment that process dies, zombie or not, and it is the ingest
    process's also for a worker forked by the forkserver (whose parent, by pid, is the server).
    """
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: nothing to watch
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _parse_in_worker(item: SourceItem, stream_above: int) -> Parsed:
    parsed = parse_whole(item, stream_above)
    if isinstance(parsed, Exception):
        # Any exception type may come from a parser, and not every one survives pickling: send the
        # reason as it would be reported instead.
        return ParseFailure(failure_reason(parsed))
    return parsed


class ParsePool:
    """Worker processes that parse whole sources; started on the first `submit`."""

    def __init__(self, workers: int, stream_above: int) -> None:
        """
        Args:
            workers: processes (>= 2; 1 means parse in process, without a pool).
            stream_above: as `parse_item_stream`; sources above it are not sent here.
        """
        assert workers >= 2
        self.workers = workers
        self.stream_above = stream_above
        self._executor: ProcessPoolExecutor | None = None
        self._broken = False

    def submit(self, item: SourceItem) -> Future[Parsed] | None:
        """Start parsing `item` in a worker; None when the pool broke (parse it in process then)."""
        if self._broken:
            return None
        if self._executor is None:
            self._executor = ProcessPoolExecutor(self.workers, mp_context=_context(),
                                                 initializer=_exit_with_parent)
        try:
            return self._executor.submit(_parse_in_worker, item, self.stream_above)
        except BrokenProcessPool:
            self._break()
            return None

    def result(self, item: SourceItem, job: Future[Parsed]) -> Parsed:
        """The parse of `item`; in process when its worker died (killed for memory, a crashed parser)."""
        try:
            return job.result()
        except BrokenProcessPool:
            self._break()
            return parse_whole(item, self.stream_above)

    def close(self) -> None:
        """Stop the workers (sources not yet handed out are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _break(self) -> None:
        if not self._broken:
            log.warning("a parse worker process died; parsing the rest of this run in process")
        self._broken = True
        self.close()
