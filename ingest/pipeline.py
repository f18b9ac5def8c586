"""Ingest: walk → (skip unchanged) → parse → chunk → embed (batched) → write; incremental.

Each document is written whole (a savepoint of the embed batch's transaction in the embedded
catalog), so an interrupted run keeps every document of the batches it committed and the previous
version of the others. The catalog is the
checkpoint: a re-run skips what is done by content hash, so a job killed at any point
resumes without re-embedding finished documents. A source that fails (corrupt, binary,
unreadable...) is reported with its reason and leaves its stored version, if any, untouched;
only documents that are really gone from an ingested root are deleted.

Memory does not grow with the corpus beyond a small record per stored document (key, hash,
ACL: what unchanged and vanished documents are found with): the walk is lazy, and only one
batch of parsed documents waits for the embedder at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from ingest.acl_changes import AclProblem, Widening, widens
from ingest.batch_commit import BatchCommitter, CommitCounts, OpenDocument
from ingest.chunk import Chunker
from ingest.deletion_guard import DeletionGuard, DeletionRefusal
from ingest.parse import STREAM_ABOVE_BYTES, document_bytes, is_streamed, parse_item_stream
from ingest.parse_pool import Parsed, ParsePool, failure_reason, parse_whole, start_forkserver
from ingest.source_names import SourceNamer
from ingest.sources import (
    COVERS_SOURCE,
    SourceItem,
    SourceProblem,
    count_sources,
    has_sources,
    is_under_any,
    scan_roots,
    walk_sources,
)
from ingest.staging import ChunkStaging
from ingest.vanished import NOBODY, Holds, restrict, settle_vanished
from rag.errors import IngestError
from rag.switch_interval import OVERLAP_SWITCH_INTERVAL_MS
from retrieval.base import CollectionStore
from retrieval.records import BuildOutcome, DocumentCounts, DocumentState

log = logging.getLogger(__name__)

# Progress callback: (stage, done, total), total 0 when unknown. Stages: "scan" (counting the
# sources), "ingest" (sources handled, of those counted), "embed" (chunks embedded so far),
# "tokens" (tokens embedded so far).
ProgressFn = Callable[[str, int, int], None]

T = TypeVar("T")

# Documents above this size are not ingested (reported as skipped): formats parsed whole (PDF, DOCX,
# HTML) take several times their size in memory, and a streamed text file's final write holds its
# chunks and vectors (about 3x its size). rag/settings.py's max_document_bytes sets it.
DEFAULT_MAX_DOCUMENT_BYTES = 100 * 1024 * 1024
# A window of parsed documents (whose texts are tokenized together) holds at most this much text.
WINDOW_TEXT_CHARS = 32 << 20


@dataclass
class Problem:
    key: str
    reason: str


@dataclass
class Skipped:
    """A source over the size cap: not read; a stored version of it stays as it was (ACL updated)."""

    key: str
    bytes: int
    max_bytes: int


@dataclass
class IngestReport(DocumentCounts):
    """What a run did; `ok` is False when any source failed, any ACL could not be determined, or
    deletions were refused."""

    tokens_embedded: int = 0
    chunks_embedded: int = 0  # sent to the embedder by this run
    chunks_resumed: int = 0  # embedded by an interrupted run (staged), not again by this one
    problems: list[Problem] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # over max_document_bytes
    seconds: dict[str, float] = field(default_factory=dict)  # per stage, and "total"
    build: BuildOutcome | None = None  # set when the run built a new version of the collection
    acl_errors: list[AclProblem] = field(default_factory=list)  # stored/kept readable by nobody
    widened: list[Widening] = field(default_factory=list)  # readable by more principals than before
    deletion_refused: DeletionRefusal | None = None  # too many deletions at once: none were made

    @property
    def ok(self) -> bool:
        return not self.problems and not self.acl_errors and self.deletion_refused is None

    @property
    def documents(self) -> int:
        """Sources that are in the collection as they are now (written, checked or ACL-updated)."""
        return self.added + self.updated + self.unchanged + self.acl_updated

    def rates(self) -> dict[str, float]:
        """Throughput: documents/s over the run, and per stage for the documents that went through it."""
        embedded = self.added + self.updated
        out = {"documents_per_second": _rate(self.documents + len(self.problems), self.seconds.get("total"))}
        for stage in ("parse", "chunk", "embed", "write"):
            out[f"{stage}_documents_per_second"] = _rate(embedded, self.seconds.get(stage))
        out["embed_chunks_per_second"] = _rate(self.chunks_written, self.seconds.get("embed"))
        out["embed_tokens_per_second"] = _rate(self.tokens_embedded, self.seconds.get("embed"))
        return out

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "documents": self.documents, "added": self.added, "updated": self.updated,
            "unchanged": self.unchanged, "acl_updated": self.acl_updated,
            "deleted": self.deleted, "chunks_written": self.chunks_written,
            "tokens_embedded": self.tokens_embedded,
            "chunks_embedded": self.chunks_embedded, "chunks_resumed": self.chunks_resumed,
            "skipped": [{"source": s.key, "bytes": s.bytes, "max_bytes": s.max_bytes} for s in self.skipped],
            "problems": [{"source": p.key, "reason": p.reason} for p in self.problems],
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "rates": self.rates(),
            "build": self.build.as_dict() if self.build else None,
            "acl_errors": [a.as_dict() for a in self.acl_errors],
            "widened": [w.as_dict() for w in self.widened],
            "deletion_refused": self.deletion_refused.as_dict() if self.deletion_refused else None,
        }


class IngestPipeline:
    """Brings a collection in line with the sources under some paths."""

    def __init__(self, store: CollectionStore, embed: Callable[[Sequence[str]], np.ndarray],
                 chunker: Chunker, batch_chunks: int = 256, namer: SourceNamer | None = None,
                 guard: DeletionGuard | None = None,
                 max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES, staging_path: Path | None = None,
                 stream_above_bytes: int = STREAM_ABOVE_BYTES, chunk_batch: int = 256, workers: int = 1,
                 overlap_embedding: bool = True, switch_interval_ms: float = OVERLAP_SWITCH_INTERVAL_MS,
                 embed_ready: Callable[[], None] | None = None, write_behind: bool = True) -> None:
        """
        Args:
            guard: how much a run may delete (default: at most half the collection, and never
                everything under a root that yields nothing).
            store: where documents go; a rebuild (`retrieval.rebuild.CollectionBuild`) is switched to at the end
                of a run that completed it.
            batch_chunks: chunks embedded per call; parsed documents wait for the embedder until
                their chunks fill a batch, so this bounds what a run holds besides stored states.
                After each call its work is committed (`ingest.batch_commit`): a killed run
                loses at most the batches not yet written (with overlap, up to three).
            overlap_embedding: embed each batch on a thread of its own while the run reads,
                chunks and writes the others (False: one thing at a time; the same rows).
            write_behind: with overlap, write to the store on a thread of its own too, in order,
                while this one reads and chunks (False: this thread writes each batch; the same rows).
            switch_interval_ms: the GIL switch interval while the embed thread runs (0: unchanged).
            embed_ready: waits until `embed` can run (a model loading in a worker process while
                this run walks and parses); its wait is the stage "embed_start".
            max_document_bytes: sources larger than this are skipped and reported (0: no cap).
            staging_path: the SQLite file where a document's chunks wait until the last one is
                embedded (durable, so a restart resumes inside a huge document); None keeps
                them in memory. A finished run deletes it.
            stream_above_bytes: text and Markdown files above this are parsed block by block.
            chunk_batch: sources parsed ahead of the one being written (at most `WINDOW_TEXT_CHARS`
                of text), whose element texts the chunker tokenizes in one call (`Chunker.precount`);
                1 parses and tokenizes one source at a time. Sources are still handled, written and
                reported in the walk's order.
            workers: processes that parse the sources of the window (`ingest.parse_pool`), at most
                `chunk_batch` sources in flight beyond the window being handled; 1 parses in this
                process. Needs `chunk_batch` > 1. Results, problems and rows are the same.
        """
        assert chunk_batch >= 1 and workers >= 1
        if workers > 1:
            start_forkserver()  # warms the parsers while the run walks its first window
        self.chunk_batch = chunk_batch
        self.workers = workers
        self.overlap_embedding = overlap_embedding
        self.write_behind = write_behind
        self.switch_interval_ms = switch_interval_ms
        self.embed_ready = embed_ready
        self.max_document_bytes = max_document_bytes
        self.staging_path = staging_path
        self.stream_above_bytes = stream_above_bytes
        self.store = store
        self.embed = embed
        self.chunker = chunker
        self.batch_chunks = batch_chunks
        self.max_pending_chunks = 0  # the most chunks that ever waited for the embedder (tests)
        self.namer = namer or SourceNamer()  # what citations call each source
        self.guard = guard or DeletionGuard()

    def run(self, paths: Sequence[Path], progress: ProgressFn | None = None,
            shard: tuple[int, int] | None = None, collection_documents: int | None = None) -> IngestReport:
        """Ingest every supported source under `paths`.

        Args:
            progress: called as the run goes (see ProgressFn); with it, the sources are counted
                first (a cheap walk that reads no file but JSONL line ends) to give a total.
            shard: (index, count): handle only the documents whose key hashes to this shard
                (`shard_of`), and delete only vanished documents of this shard, so `count`
                jobs over the same paths split the work without overlap.
            collection_documents: for a shard whose store holds only its part (an embedded shard),
                the documents of the whole collection, so that the mass-delete guard's fraction is of
                a fair share of them rather than of a few documents that happened to hash here.

        Raises:
            ConfigError: a path does not exist (nothing is changed then).
            MassDeleteError: a root yields no sources while the collection holds documents
                under it (an unmounted file system?), unless the guard allows mass deletes
                (nothing is changed then).
        """
        started = time.perf_counter()
        report = IngestReport()
        clock = _Clock(report.seconds)
        total = 0
        with clock("scan"):
            roots = scan_roots(paths)
            if progress:
                progress("scan", 0, 0)
                total = count_sources(roots)
            # Shrinks as sources are found: what is left at the end has no source any more.
            stored = self.store.document_states()
            self.guard.check_roots(roots, stored, has_sources)
        if progress:
            progress("ingest", 0, total)
        if self.store.notice:
            log.info("%s", self.store.notice)

        def mine(key: str) -> bool:
            return shard is None or shard_of(key, shard[1]) == shard[0]

        # What the guard's fraction is of: the collection's documents, or a shard's fair share of
        # them (its total / shard count). Not the documents that hashed to this shard: on a small
        # collection that count is noisy (2 of a shard's 3 documents may be 2 of 15), and a run
        # over a vanished subtree still deletes far more than its share in every shard.
        num_mine = len(stored) if shard is None else max(
            sum(1 for key in stored if mine(key)), -(-(collection_documents or len(stored)) // shard[1]))
        holds = Holds()  # problems that speak for documents the walk could not see
        staging = ChunkStaging(self.staging_path, _staging_scope(self.store))

        def on_batch(counts: CommitCounts) -> None:
            if progress:  # moves within a huge document too: one step per embed batch
                progress("embed", counts.chunks_embedded + counts.chunks_resumed, 0)
                progress("tokens", counts.tokens_embedded, 0)

        committer = BatchCommitter(self.store, self.embed, self.batch_chunks, staging,
                                   lambda entry: _count_written(entry, report), clock, on_batch,
                                   overlap=self.overlap_embedding, switch_interval_ms=self.switch_interval_ms,
                                   embed_ready=self.embed_ready, write_behind=self.write_behind)
        def wants_parse(item: SourceItem | SourceProblem) -> bool:
            if isinstance(item, SourceProblem) or not mine(item.key):
                return False
            old = stored.get(item.key)
            return (old is None or old.content_hash != item.content_hash) and not self._is_over_cap(item)

        walk = _timed(walk_sources(roots, namer=self.namer), clock, "scan")
        # closing: the parse workers and the embed thread stop also when a write or the embedder fails
        with contextlib.closing(committer), contextlib.closing(self._parsed_ahead(walk, wants_parse, clock)) as ahead:
            for n, (item, parsed) in enumerate(ahead, 1):
                is_hold = isinstance(item, SourceProblem) and item.covers != COVERS_SOURCE
                if is_hold:
                    holds.add(item)  # in every shard: what it covers may be any shard's
                old = None if is_hold else stored.pop(item.key, None)
                if not mine(item.key):
                    pass
                elif isinstance(item, SourceProblem):
                    report.problems.append(Problem(item.key, item.reason))
                    if old is not None:
                        self._keep(item, old, report, committer)
                else:
                    self._one(item, old, report, committer, clock, parsed)
                if progress:
                    progress("ingest", n, max(total, n))
                self.max_pending_chunks = max(self.max_pending_chunks, committer.waiting)
                if committer.waiting >= self.batch_chunks:
                    committer.send()
                else:
                    committer.poll()  # the writer's progress, and its error ends the run here
            committer.flush()
        report.chunks_embedded = committer.counts.chunks_embedded
        report.chunks_resumed = committer.counts.chunks_resumed

        with clock("delete"):
            report.acl_errors.extend(holds.restrict_ambiguous(self.store, mine))
            vanished = {k: s for k, s in stored.items() if mine(k) and is_under_any(k, roots)}
            outcome = settle_vanished(self.store, vanished, holds, self.guard, num_mine)
            report.deleted = outcome.deleted
            report.acl_errors.extend(outcome.held)
            report.deletion_refused = outcome.refusal
        with clock("save"):
            self.store.save()
        staging.remove()  # everything staged was written (or its source failed)
        switch_started = time.perf_counter()
        report.build = self.store.finish()  # a rebuild switches to its new version here when complete
        if report.build is not None:
            report.seconds["switch"] = time.perf_counter() - switch_started
        report.seconds["total"] = time.perf_counter() - started
        return report

    def _keep(self, problem: SourceProblem, old: DocumentState, report: IngestReport,
              committer: BatchCommitter) -> None:
        """A stored document whose source failed stays, with the source's ACL now, else nobody's."""
        acl = NOBODY if problem.acl is None else problem.acl
        if problem.acl is None:
            report.acl_errors.append(AclProblem(problem.key, f"kept, readable by nobody: {problem.reason}"))
        elif widens(old.acl, acl):
            report.widened.append(Widening(problem.key, old.acl, acl))
        if old.acl != acl:
            committer.store_write(restrict, self.store, problem.key, acl)

    def _parsed_ahead(self, items: Iterator[SourceItem | SourceProblem],
                      wants_parse: Callable[[SourceItem | SourceProblem], bool],
                      clock: _Clock) -> Iterator[tuple[SourceItem | SourceProblem, Parsed | None]]:
        """The items, each with its parse when it was parsed ahead (else None: `_one` parses it).

        Windows of up to `chunk_batch` items (and `WINDOW_TEXT_CHARS` of parsed text) are parsed,
        then their texts are tokenized in one call (`Chunker.count_batch`) on a thread of its own
        while the window before is handed on and chunked (the call releases the GIL): at most two
        windows of parsed documents are held at a time. Streamed (huge text) files are not
        parsed ahead. With `chunk_batch` 1 nothing is (the one-at-a-time path). With `workers`
        > 1, up to `chunk_batch` sources beyond the window are being parsed in worker processes
        while it is handled; results are taken in the walk's order.
        """
        if self.chunk_batch == 1:
            yield from ((item, None) for item in items)
            return
        pool = ParsePool(self.workers, self.stream_above_bytes) if self.workers > 1 else None
        # Sources taken from the walk whose parse is running (a Future), done, or not wanted (None).
        pending: deque[tuple[SourceItem | SourceProblem, Future[Parsed] | Parsed | None]] = deque()
        ahead = self.chunk_batch if pool is not None else 1  # in process: parse each when its turn comes
        walked = False
        counter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-count")
        previous: tuple[list[tuple[SourceItem | SourceProblem, Parsed | None]], Future[dict[str, int]]] | None = None
        try:
            while True:
                window: list[tuple[SourceItem | SourceProblem, Parsed | None]] = []
                chars = 0
                while len(window) < self.chunk_batch and chars < WINDOW_TEXT_CHARS:
                    while not walked and len(pending) < ahead:
                        item = next(items, None)
                        if item is None:
                            walked = True
                        else:
                            pending.append((item, self._start_parse(item, wants_parse, pool, clock)))
                    if not pending:
                        break
                    item, job = pending.popleft()
                    if isinstance(job, Future):
                        assert pool is not None and isinstance(item, SourceItem)
                        with clock("parse"):  # the wait for a worker: what parsing adds to the run
                            job = self._await(item, job, pending, pool)
                    if job is not None and not isinstance(job, Exception):
                        chars += sum(len(e.text) for e in job[1])
                    window.append((item, job))
                counting = counter.submit(self.chunker.count_batch, [
                    text for _, p in window if p is not None and not isinstance(p, Exception)
                    for text in (p[0].title or "", *(e.text for e in p[1]))]) if window else None
                if previous is not None:
                    with clock("chunk"):  # the wait for its counts: what tokenizing adds to the run
                        self.chunker.use_counts(previous[1].result())
                    yield from previous[0]
                if counting is None:
                    return
                previous = (window, counting)
        finally:
            counter.shutdown(wait=True, cancel_futures=True)
            if pool is not None:
                pool.close()

    def _await(self, item: SourceItem, job: Future[Parsed],
               pending: deque[tuple[SourceItem | SourceProblem, Future[Parsed] | Parsed | None]],
               pool: ParsePool) -> Parsed:
        """`item`'s parse; meanwhile this process parses the pending sources no worker has started.

        Workers take seconds to start (a fresh interpreter importing the parsers): instead of waiting
        idle, this process takes sources back from the queue (a cancelled Future was never started)
        and parses them itself, the same function with the same result.
        """
        for i in range(len(pending)):
            if job.done():
                break
            other, other_job = pending[i]
            if isinstance(other_job, Future) and other_job.cancel():
                assert isinstance(other, SourceItem)
                pending[i] = (other, parse_whole(other, self.stream_above_bytes))
        return pool.result(item, job)

    def _start_parse(self, item: SourceItem | SourceProblem,
                     wants_parse: Callable[[SourceItem | SourceProblem], bool], pool: ParsePool | None,
                     clock: _Clock) -> Future[Parsed] | Parsed | None:
        """Parse `item` ahead: in a worker (a Future), in process (its result), or not (None)."""
        if not wants_parse(item) or is_streamed(item, self.stream_above_bytes):
            return None
        assert isinstance(item, SourceItem)
        # A JSONL record is split into paragraphs faster than it is sent to a worker and back.
        job = pool.submit(item) if pool is not None and item.kind == "file" else None
        if job is not None:
            return job
        with clock("parse"):
            return parse_whole(item, self.stream_above_bytes)

    def _one(self, item: SourceItem, old: DocumentState | None, report: IngestReport,
             committer: BatchCommitter, clock: _Clock, parsed: Parsed | None = None) -> None:
        if item.acl_error is not None:
            report.acl_errors.append(AclProblem(item.key, item.acl_error))
        if old is not None and widens(old.acl, item.acl):
            report.widened.append(Widening(item.key, old.acl, item.acl))
        if old is not None and old.content_hash == item.content_hash:
            if old.acl != item.acl:
                committer.store_write(self.store.set_acl, item.key, item.acl)
                report.acl_updated += 1
            else:
                report.unchanged += 1
            return
        if self._over_cap(item, report):
            self._keep_acl(item, old, committer)
            return
        # Parsing and chunking stream (a huge text file is read a block at a time): the chunks
        # go to the committer as they come, which embeds and commits them a batch at a time.
        try:
            if parsed is None:
                with clock("parse"):
                    doc, elements = parse_item_stream(item, self.stream_above_bytes)
            elif isinstance(parsed, Exception):
                raise parsed
            else:
                doc, elements = parsed[0], iter(parsed[1])
        except Exception as e:
            self._failed(item, old, e, report, committer)
            return
        committer.begin(doc, item.acl, is_new=old is None)
        parsing: dict[str, float] = {}  # the part of "chunk" spent reading later blocks
        chunks = self.chunker.iter_chunks(doc, _timed(elements, _Clock(parsing), "parse"))
        try:
            while True:
                try:
                    with clock("chunk"):
                        chunk = next(chunks, None)
                except Exception as e:  # a later block failed to parse: none of the document is written
                    committer.abort()
                    self._failed(item, old, e, report, committer)
                    return
                if chunk is None:
                    break
                committer.add(chunk)  # may embed a batch: its errors are not this source's, they end the run
        finally:
            moved = parsing.get("parse", 0.0)
            clock.add("parse", moved)
            clock.add("chunk", -moved)
        with clock("write"):
            num_chunks = committer.end()
        if not num_chunks:
            report.problems.append(Problem(item.key, "no text extracted"))
            self._keep_acl(item, old, committer)

    def _failed(self, item: SourceItem, old: DocumentState | None, e: Exception, report: IngestReport,
                committer: BatchCommitter) -> None:
        if not isinstance(e, IngestError):  # a parser bug must not end the run; say what it was
            log.debug("parse failed for %s", item.key, exc_info=e)
        report.problems.append(Problem(item.key, failure_reason(e)))
        self._keep_acl(item, old, committer)

    def _over_cap(self, item: SourceItem, report: IngestReport) -> bool:
        if not self._is_over_cap(item):
            return False
        report.skipped.append(Skipped(item.key, document_bytes(item), self.max_document_bytes))
        return True

    def _is_over_cap(self, item: SourceItem) -> bool:
        if not self.max_document_bytes:
            return False
        try:
            return document_bytes(item) > self.max_document_bytes
        except OSError:
            return False  # parsing reports why it cannot be read

    def _keep_acl(self, item: SourceItem, old: DocumentState | None, committer: BatchCommitter) -> None:
        # The stored version of a source that no longer parses stays, but under the source's
        # ACL now: it may have been narrowed (or be unknown) since that version was written.
        if old is not None and old.acl != item.acl:
            committer.store_write(restrict, self.store, item.key, item.acl)


def _count_written(entry: OpenDocument, report: IngestReport) -> None:
    report.chunks_written += entry.num_chunks
    report.tokens_embedded += entry.num_tokens
    if entry.is_new:
        report.added += 1
    else:
        report.updated += 1


def _staging_scope(store: CollectionStore) -> str:
    """What staged vectors are valid for: this collection, embedder and chunking."""
    info = store.info
    return json.dumps([store.name, info.embedder, info.fingerprint, info.dim, info.chunking], sort_keys=True)


def shard_of(key: str, count: int) -> int:
    """Stable shard of a document key in [0, count): the same on every machine and run."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def _rate(count: int, seconds: float | None) -> float:
    return round(count / seconds, 1) if seconds else 0.0


def _timed(items: Iterable[T], clock: _Clock, stage: str) -> Iterator[T]:
    """The items, with the time spent producing each one (walking, hashing) added to `stage`."""
    it = iter(items)
    while True:
        with clock(stage):
            item = next(it, None)
        if item is None:
            return
        yield item


class _Clock:
    """Adds the time spent in each stage to a dict; the ingest's threads time their stages at once."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()

    def __call__(self, stage: str) -> _Timing:
        return _Timing(self, stage)

    def add(self, stage: str, seconds: float) -> None:
        """Count time measured elsewhere (the embed thread's own clock) to a stage."""
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


class _Timing:
    """`with clock(stage):` times one stretch of a stage."""

    __slots__ = ("clock", "stage", "started")

    def __init__(self, clock: _Clock, stage: str) -> None:
        self.clock, self.stage, self.started = clock, stage, 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.add(self.stage, time.perf_counter() - self.started)
