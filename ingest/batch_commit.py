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
chunking and writing took 4x the embedding of the same 50,000 chunks). At most three batches are
held: the one being written, the one on the embedder and the one filling. The embed thread only
computes vectors; every store write, staging file and callback stays on the caller's thread, in
batch order.
"""

from __future__ import annotations

import logging
import time
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


class BatchCommitter:
    """Queues the chunks of one document at a time and commits after every embed batch."""

    def __init__(self, index: CollectionStore, embed: Callable[[Sequence[str]], np.ndarray], batch_chunks: int,
                 staging: ChunkStaging, on_written: Callable[[OpenDocument], None],
                 clock: StageClock, on_batch: Callable[[CommitCounts], None] | None = None,
                 overlap: bool = True, switch_interval_ms: float = OVERLAP_SWITCH_INTERVAL_MS,
                 embed_ready: Callable[[], None] | None = None) -> None:
        """
        Args:
            on_written: called after a document was written to the store.
            clock: times the stages: "embed" (the embedder's own time, on its thread), "embed_wait"
                (the time the ingest waited for it: what overlap did not hide), "write".
            on_batch: called after each embed batch was committed (progress).
            overlap: embed a batch on a thread of its own while the ingest goes on; False: embed
                and write each batch before `add` returns (the order of work of one thread).
            switch_interval_ms: the GIL switch interval while the embed thread runs (0: the
                interpreter's own; rag/switch_interval.py says why).
            embed_ready: waits until the embedder can embed (a model loading in a worker process
                while this run reads); called before the first batch, its time counted as the
                stage "embed_start", not "embed".
        Call `close()` when done (`flush()` first to keep the work).
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
        entry.waiting += 1
        self._queue.append((entry, chunk))

    def end(self) -> int:
        """The current document has no more chunks; returns how many it had (0: nothing is written)."""
        entry, self._current = self._current, None
        assert entry is not None
        entry.complete = True
        if entry.num_chunks and entry.waiting == 0:  # its last chunk was embedded (or staged) already
            self._write([entry])
        return entry.num_chunks

    def abort(self) -> None:
        """Drop the current document: its queued chunks are not embedded, its staged ones go."""
        entry, self._current = self._current, None
        if entry is None:
            return
        entry.aborted = True  # chunks of it on the embedder come back to nothing
        self._queue = [(e, c) for e, c in self._queue if e is not entry]
        if entry._staged or entry.num_chunks:
            self.staging.discard(entry.doc.key)

    def send(self) -> None:
        """Send the queued chunks to the embedder; with overlap, the batch before them is written meanwhile.

        Without overlap the batch is embedded and written before this returns. With it, this
        returns once the previous batch is written, while this one is still being embedded.
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
        previous, self._inflight = self._inflight, (queue, self._thread.submit(self._timed_embed, texts))
        if previous is not None:
            self._collect(previous)

    def flush(self) -> None:
        """Embed everything queued and write (or stage) all of it before returning."""
        self.send()
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            self._collect(previous)

    def close(self) -> None:
        """Stop the embed thread; a batch still on it is dropped (`flush()` first to keep it)."""
        self._inflight = None
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)  # an embed call under way ends first
            self._thread = None
        if self._lowered:
            self._lowered = False
            release_shorter()

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
        with self.clock("embed_wait"):
            vectors, seconds, waited = future.result()  # the embedder's error ends the run here
        self._commit(queue, vectors, seconds, waited)

    def _commit(self, queue: Batch, vectors: np.ndarray, embed_seconds: float, start_seconds: float) -> None:
        """Write the documents a batch completes and stage the rest, then flush the store."""
        self.clock.add("embed", embed_seconds)
        if start_seconds:
            self.clock.add("embed_start", start_seconds)
        self.max_batch = max(self.max_batch, len(queue))
        touched: dict[int, OpenDocument] = {}
        for (entry, chunk), vector in zip(queue, vectors, strict=True):
            entry.waiting -= 1
            if entry.aborted:
                continue
            entry._ready.append(chunk)
            entry._vectors.append(vector)
            touched[id(entry)] = entry
        self.counts.chunks_embedded += len(queue)
        self.counts.tokens_embedded += sum(c.num_tokens for _, c in queue)
        self.counts.batches += 1
        log.info("embedded batch %d: %d chunks (%d in this run)", self.counts.batches, len(queue),
                 self.counts.chunks_embedded)
        with self.clock("write"):
            try:
                whole = []
                for entry in touched.values():
                    if entry.complete and entry.waiting == 0:
                        whole.append(entry)
                    else:  # still being read (or waiting for more of its chunks): keep the work
                        self._stage(entry)
                self._write(whole)
            finally:  # also when a write failed: the batches written before it are whole
                self.index.flush()
        if self.on_batch is not None:
            self.on_batch(self.counts)

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
        else:
            chunks, vectors = entry._ready, np.stack(entry._vectors)
        assert [c.index for c in chunks] == list(range(entry.num_chunks)), doc.key
        return DocumentWrite(doc, entry.acl, chunks, vectors)
