"""Chunks → fixed-size embed batches → committed: after each batch, all its work is durable.

Each embed call takes at most `batch_chunks` chunks, from as many documents as it takes to fill
it. When it returns, every document whose last chunk it embedded is written to the store, and the
store is flushed: the batch's documents commit in one transaction where the store batches
(the embedded catalog: a savepoint per document; pgvector), each whole. The embedded chunks
of the document still being read are staged (`ingest.staging`), so a kill at any moment loses at
most the batches not yet written (and the documents a store had not yet committed, which the next
run writes again), and a huge document never shows half of a new version: it is written whole once
its last chunk is embedded.

Overlap (on by default): a full batch goes to one embed thread, and the ingest goes on reading,
chunking and writing while it is embedded; the batch before it is written while this one is on
the embedder. On a GPU node the embedder is otherwise idle for all of the CPU stages (on an H200,
chunking and writing took 4x the embedding of the same 50,000 chunks). The embed thread only
computes vectors. Without write-behind, every store write, staging file and callback stays on the
caller's thread, in batch order, and at most three batches are held: the one being written, the
one on the embedder and the one filling.

Write-behind (with the overlap, on by default): the writes leave the caller's thread as well. One
writer thread takes, in the order the caller asked for them, each batch's commit (it waits for the
batch's vectors, then writes and stages), the write of a document whose chunks were all embedded
before `end`, the staging discard of an aborted one, and the ACL changes the caller makes between
documents (`store_write`). The caller waits only when `_MAX_BEHIND` batches are behind it. SQLite's
statements and the store's index work release the GIL, so they run beside the caller's reading
and chunking; the Python around them still takes turns with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ingest.staging import ChunkStaging, text_hash
from rag.switch_interval import OVERLAP_SWITCH_INTERVAL_MS, acquire_shorter, release_shorter
from rag.types import Chunk, Document
from retrieval.base import CollectionStore
from retrieval.records import DocumentWrite

log = logging.getLogger(__name__)


@dataclass
class OpenDocument:
    """A document whose chunks are being embedded."""

    doc: Document
    acl: frozenset[str]
    is_new: bool
    num_chunks: int = 0  # chunks produced so far (all of them once `complete`)
    num_tokens: int = 0
    complete: bool = False
    aborted: bool = False  # dropped while some of its chunks were on the embedder: their vectors are not kept
    waiting: int = 0  # chunks in the queue or on the embedder, not embedded yet
    reused: int = 0  # chunks found staged by an earlier run, not embedded again
    _staged: dict[int, str] = field(default_factory=dict)  # index -> text hash, in the staging file
    _ready: list[Chunk] = field(default_factory=list)  # embedded in the last batch, not staged
    _vectors: list[np.ndarray] = field(default_factory=list)


@dataclass
class CommitCounts:
    """What the committer did, for the run's report and progress."""

    chunks_embedded: int = 0  # sent to the embedder in this run
    tokens_embedded: int = 0
    chunks_resumed: int = 0  # taken from staging instead (embedded by an interrupted run)
    batches: int = 0


class StageClock(Protocol):
    """Times the stages of a run: `with clock("write"): ...`, and `clock.add(stage, seconds)`."""

    def __call__(self, stage: str) -> AbstractContextManager[None]: ...

    def add(self, stage: str, seconds: float) -> None: ...


Batch = list[tuple[OpenDocument, Chunk]]

# With write-behind, the caller waits when this many batches are behind it (on the embedder or
# the writer): the memory held, and what a kill loses, stay bounded.
_MAX_BEHIND = 3


class BatchCommitter:
    """Queues the chunks of one document at a time and commits after every embed batch."""

    def __init__(self, index: CollectionStore, embed: Callable[[Sequence[str]], np.ndarray], batch_chunks: int,
                 staging: ChunkStaging, on_written: Callable[[OpenDocument], None],
                 clock: StageClock, on_batch: Callable[[CommitCounts], None] | None = None,
                 overlap: bool = True, switch_interval_ms: float = OVERLAP_SWITCH_INTERVAL_MS,
                 embed_ready: Callable[[], None] | None = None, write_behind: bool = True) -> None:
        """
        Args:
            on_written: called after a document was written to the store (on the writer thread
                with `write_behind`).
            clock: times the stages (from two threads at once with `write_behind`): "embed" (the
                embedder's own time, on its thread), "embed_wait" (the time the caller waited for
                the batches behind it: what overlap did not hide), "write", and with
                `write_behind` "writer_idle" (the writer waiting for the embedder).
            on_batch: called after each embed batch was committed (progress), on the caller's thread.
            overlap: embed a batch on a thread of its own while the ingest goes on; False: embed
                and write each batch before `add` returns (the order of work of one thread).
            switch_interval_ms: the GIL switch interval while the embed thread runs (0: the
                interpreter's own; rag/switch_interval.py says why).
            embed_ready: waits until the embedder can embed (a model loading in a worker process
                while this run reads); called before the first batch, its time counted as the
                stage "embed_start", not "embed".
            write_behind: with overlap, every store and staging write runs on one writer thread
                of its own, in the order the caller asked for them, while the caller reads and
                chunks the next documents; False: the caller's thread writes each batch when
                it sends the next one.
        Call `close()` when done (`flush()` first to keep the work). With `write_behind`, store
        writes the caller makes between batches go through `store_write`, so that they keep
        their order with the batches' (and one thread holds the store's write transaction).
        """
        assert batch_chunks >= 1
        self.index = index
        self.embed = embed
        self.batch_chunks = batch_chunks
        self.staging = staging
        self.on_written = on_written
        self.clock = clock
        self.on_batch = on_batch
        self.counts = CommitCounts()
        self.max_batch = 0  # the largest embed call (tests)
        self._queue: Batch = []
        self._current: OpenDocument | None = None
        self._overlap = overlap
        self._switch_interval_ms = switch_interval_ms
        self._lowered = False
        self._thread: ThreadPoolExecutor | None = None
        self._inflight: tuple[Batch, Future[tuple[np.ndarray, float, float]]] | None = None
        self._embed_ready = embed_ready
        # Write-behind: the writer's tasks in submission order, each marked whether it commits a batch.
        self._write_behind = overlap and write_behind
        self._writer: ThreadPoolExecutor | None = None
        self._writes: deque[tuple[bool, Future[None]]] = deque()
        self._batches_behind = 0  # batch commits submitted to the writer and not yet collected
        self._writer_failed = False  # a writer task raised: the ones after it do nothing
        self._reported = 0  # batches passed to on_batch
        # OpenDocument.waiting, .complete and .aborted change on both threads with write-behind.
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def begin(self, doc: Document, acl: frozenset[str], is_new: bool) -> None:
        """Start a document; its chunks follow through `add`, then `end` (or `abort`)."""
        assert self._current is None, "end() or abort() the previous document first"
        entry = OpenDocument(doc, acl, is_new)
        entry._staged = self.staging.staged(doc.key, doc.content_hash)
        self._current = entry

    def add(self, chunk: Chunk) -> None:
        """Queue one chunk of the current document (unless an interrupted run staged it already)."""
        entry = self._current
        assert entry is not None and chunk.index == entry.num_chunks
        entry.num_chunks += 1
        entry.num_tokens += chunk.num_tokens
        if entry._staged.get(chunk.index) == text_hash(chunk.text):
            entry.reused += 1
            self.counts.chunks_resumed += 1
            return
        if len(self._queue) >= self.batch_chunks:
            # Full: send it to the embedder before this chunk joins. A queue that the document's
            # last chunk fills waits for the caller's `send` after `end`, so that document is
            # written, not staged.
            self.send()
        with self._lock:
            entry.waiting += 1
        self._queue.append((entry, chunk))

    def end(self) -> int:
        """The current document has no more chunks; returns how many it had (0: nothing is written)."""
        entry, self._current = self._current, None
        assert entry is not None
        with self._lock:
            entry.complete = True
            whole = entry.num_chunks > 0 and entry.waiting == 0  # its last chunk was embedded (or staged) already
        if whole:
            self._in_order(self._write, [entry])
        return entry.num_chunks

    def abort(self) -> None:
        """Drop the current document: its queued chunks are not embedded, its staged ones go."""
        entry, self._current = self._current, None
        if entry is None:
            return
        with self._lock:
            entry.aborted = True  # chunks of it on the embedder come back to nothing
        self._queue = [(e, c) for e, c in self._queue if e is not entry]
        if entry._staged or entry.num_chunks:
            self._in_order(self.staging.discard, entry.doc.key)

    def store_write(self, write: Callable[..., object], *args: object) -> None:
        """Make a store write (an ACL change between documents) in order with the batches' writes.

        With write-behind it runs on the writer thread after the writes asked for before it, and
        its error ends the run at the next `send`, `poll` or `flush`; else now. Timed as "write".
        """
        if self._write_behind:
            self._in_order(write, *args)
        else:
            self._timed_write(write, *args)

    def send(self) -> None:
        """Send the queued chunks to the embedder; with overlap, the batches before them are written meanwhile.

        Without overlap the batch is embedded and written before this returns. With it, this
        returns once the previous batch is written (without write-behind), or once at most
        `_MAX_BEHIND` batches wait for the embedder and the writer (with it), while this one is
        still being embedded.
        """
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        texts = [c.text for _, c in queue]
        if not self._overlap:
            self._commit(queue, *self._timed_embed(texts))
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-embed")
            # The embed thread's many short GPU launches would otherwise wait up to 5 ms each for
            # the GIL while this thread chunks and writes (rag/switch_interval.py).
            if self._switch_interval_ms > 0:
                acquire_shorter(self._switch_interval_ms)
                self._lowered = True
        embedding = self._thread.submit(self._timed_embed, texts)
        if self._write_behind:
            self._submit(True, self._collect, (queue, embedding))
            self._collect_writes(_MAX_BEHIND)
            return
        previous, self._inflight = self._inflight, (queue, embedding)
        if previous is not None:
            self._collect(previous)

    def poll(self) -> None:
        """Report the batches the writer has committed since (progress), and raise its first error; never waits."""
        if self._write_behind:
            self._collect_writes(_MAX_BEHIND)

    def flush(self) -> None:
        """Embed everything queued and write (or stage) all of it before returning."""
        self.send()
        if self._write_behind:
            if self._writer is not None:
                self._submit(False, self.index.release_thread)  # its open batch committed, its connection closed
                self._collect_writes(None)
            return
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._collect(previous)

    def close(self) -> None:
        """Stop the embed and writer threads; batches not written are dropped (`flush()` first to keep them)."""
        self._inflight = None
        for _, task in self._writes:
            task.cancel()  # not started yet; the one running ends first
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)  # an embed call under way ends first
            self._thread = None
        if self._writer is not None:
            # The documents it wrote are whole: commit them, and close its store connection.
            released = self._writer.submit(self.index.release_thread)  # also after a failed write
            self._writer.shutdown(wait=True)
            self._writer = None
            self._writes.clear()
            if not released.cancelled() and released.exception() is not None:
                log.warning("committing the ingest's last writes failed: %s", released.exception())
        if self._lowered:
            self._lowered = False
            release_shorter()

    # -- the writer thread (write-behind) ---------------------------------------------------

    def _in_order(self, write: Callable[..., object], *args: object) -> None:
        """Run `write(*args)` now, or on the writer thread after the writes submitted before it."""
        if not self._write_behind:
            write(*args)
            return
        self._submit(False, self._timed_write, write, *args)

    def _submit(self, is_batch: bool, task: Callable[..., None], *args: object) -> None:
        if self._writer is None:
            # Writes the caller made before (a shard seeded from the collection) may hold the
            # store's write transaction on its own connection: committed first, or the writer
            # would wait for it to time out.
            self.index.flush()
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-write")
        self._batches_behind += is_batch
        self._writes.append((is_batch, self._writer.submit(self._guarded, task, *args)))

    def _guarded(self, task: Callable[..., None], *args: object) -> None:
        """A writer task; after one failed, the rest do nothing (the caller raises the first error)."""
        if self._writer_failed:
            return
        try:
            task(*args)
        except BaseException:
            self._writer_failed = True
            raise

    def _timed_write(self, write: Callable[..., object], *args: object) -> None:
        with self.clock("write"):
            write(*args)

    def _collect_writes(self, keep: int | None) -> None:
        """Take the writer's finished tasks (the first error rises), waiting until at most `keep`
        batches are behind (None: until every task is done)."""
        while self._writes:
            is_batch, task = self._writes[0]
            if not task.done():
                if keep is not None and self._batches_behind <= keep:
                    break
                with self.clock("embed_wait"):  # what the embedder and the writer did not hide
                    task.result()
            self._writes.popleft()
            self._batches_behind -= is_batch
            task.result()  # the first error ends the run (later tasks did nothing)
        self._report_batches()

    def _report_batches(self) -> None:
        if self.on_batch is not None and self.counts.batches > self._reported:
            self._reported = self.counts.batches
            self.on_batch(self.counts)

    # -- embedding and committing ------------------------------------------------------------

    def _timed_embed(self, texts: list[str]) -> tuple[np.ndarray, float, float]:
        """(vectors, seconds embedding, seconds waiting for the embedder to be ready first)."""
        waited = 0.0
        if self._embed_ready is not None:  # one batch at a time reaches here: no race
            ready, self._embed_ready = self._embed_ready, None
            started = time.perf_counter()
            ready()
            waited = time.perf_counter() - started
        started = time.perf_counter()
        vectors = self.embed(texts)
        return vectors, time.perf_counter() - started, waited

    def _collect(self, inflight: tuple[Batch, Future[tuple[np.ndarray, float, float]]]) -> None:
        queue, future = inflight
        # With write-behind this is the writer waiting for the embedder, not the caller.
        with self.clock("writer_idle" if self._write_behind else "embed_wait"):
            vectors, seconds, waited = future.result()  # the embedder's error ends the run here
        self._commit(queue, vectors, seconds, waited)

    def _commit(self, queue: Batch, vectors: np.ndarray, embed_seconds: float, start_seconds: float) -> None:
        """Write the documents a batch completes and stage the rest, then flush the store."""
        self.clock.add("embed", embed_seconds)
        if start_seconds:
            self.clock.add("embed_start", start_seconds)
        self.max_batch = max(self.max_batch, len(queue))
        touched: dict[int, OpenDocument] = {}
        with self._lock:
            for (entry, chunk), vector in zip(queue, vectors, strict=True):
                entry.waiting -= 1
                if entry.aborted:
                    continue
                entry._ready.append(chunk)
                entry._vectors.append(vector)
                touched[id(entry)] = entry
            # A document is written once: here if `end` came before its last chunk was embedded,
            # else by the write `end` asks for (it sees `waiting` 0 under this lock).
            whole = {key: entry for key, entry in touched.items() if entry.complete and entry.waiting == 0}
        log.info("embedded batch %d: %d chunks (%d in this run)", self.counts.batches + 1, len(queue),
                 self.counts.chunks_embedded + len(queue))
        with self.clock("write"):
            try:
                for key, entry in touched.items():
                    if key not in whole:  # still being read (or waiting for more of its chunks): keep the work
                        self._stage(entry)
                self._write(list(whole.values()))
            finally:  # also when a write failed: the batches written before it are whole
                self.index.flush()
        # Counted once committed: the caller's progress (from another thread) never runs ahead of the store.
        self.counts.chunks_embedded += len(queue)
        self.counts.tokens_embedded += sum(c.num_tokens for _, c in queue)
        self.counts.batches += 1
        if not self._write_behind:
            self._report_batches()

    def _stage(self, entry: OpenDocument) -> None:
        if not entry._ready:
            return
        self.staging.put(entry.doc.key, entry.doc.content_hash, entry._ready, np.stack(entry._vectors))
        entry._staged.update((c.index, text_hash(c.text)) for c in entry._ready)
        entry._ready, entry._vectors = [], []

    def _write(self, entries: list[OpenDocument]) -> None:
        """Write whole documents to the store in one call (all or none), then drop what they had staged."""
        if not entries:
            return
        writes = [self._document_write(entry) for entry in entries]
        self.index.replace_documents(writes)
        staged = [entry for entry in entries if entry._staged]
        if staged:
            # After the store's commit (a store may buffer the write: flush it first): a kill in
            # between leaves rows that the next run drops (the document is unchanged then, and a
            # finished run deletes the staging file).
            self.index.flush()
            for entry in staged:
                self.staging.discard(entry.doc.key)
        for entry in entries:
            entry._ready, entry._vectors, entry._staged = [], [], {}
            self.on_written(entry)

    def _document_write(self, entry: OpenDocument) -> DocumentWrite:
        """A whole document's chunks and vectors: this run's, merged with what an earlier run staged."""
        doc = entry.doc
        if entry._staged:
            staged, staged_vectors = self.staging.take(doc.key, doc.content_hash, self.index.info.dim)
            # What this run embedded replaces a staged row of the same index.
            fresh = {c.index for c in entry._ready}
            keep = [j for j, c in enumerate(staged) if c.index < entry.num_chunks and c.index not in fresh]
            chunks = [staged[j] for j in keep] + entry._ready
            vectors = np.concatenate([staged_vectors[keep], *(v[None] for v in entry._vectors)]) \
                if entry._vectors else staged_vectors[keep]
            order = np.argsort([c.index for c in chunks], kind="stable")
            chunks = [chunks[j] for j in order]
            vectors = vectors[order]
        else:  # a one-chunk document (most JSONL records): its row of the batch's array, no copy
            chunks = entry._ready
            vectors = entry._vectors[0][None] if len(entry._vectors) == 1 else np.stack(entry._vectors)
        assert [c.index for c in chunks] == list(range(entry.num_chunks)), doc.key
        return DocumentWrite(doc, entry.acl, chunks, vectors)
