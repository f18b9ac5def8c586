"""The batch committer: overlapped embedding, and what it keeps when a document is dropped or the embedder fails.

The store is a recording stand-in (this module's unit tests); the pipeline's own tests run the
committer against the real catalog and embedder (tests/ingest/test_pipeline_memory.py,
test_resume.py, and every ingest test, where overlap is the default).
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

from ingest.batch_commit import BatchCommitter
from ingest.chunk import Chunker, ChunkingConfig
from ingest.pipeline import IngestPipeline
from ingest.staging import ChunkStaging
from rag.switch_interval import OVERLAP_SWITCH_INTERVAL_MS
from rag.types import Chunk, Document
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from tests.ingest.test_chunk_batched import fake_embed

DIM = 4


class RecordingStore:
    """What was written and when the store was flushed, in order, and which threads wrote."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(dim=DIM)
        self.events: list[tuple[str, str | None]] = []
        self.rows: dict[str, tuple[list[str], np.ndarray]] = {}
        self.threads: set[str] = set()

    def replace_document(self, doc: Document, acl: frozenset[str], chunks: list[Chunk], vectors: np.ndarray) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append(("write", doc.key))
        self.rows[doc.key] = ([c.text for c in chunks], vectors)

    def set_acl(self, key: str, acl: frozenset[str]) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append(("acl", key))

    def replace_documents(self, writes: list) -> None:
        for w in writes:
            self.replace_document(*w)

    def flush(self) -> None:
        self.events.append(("flush", None))

    def release_thread(self) -> None:
        self.events.append(("release", threading.current_thread().name))


class Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        started = time.perf_counter()
        yield
        self.add(stage, time.perf_counter() - started)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


def vectors_of(texts) -> np.ndarray:
    """A vector that says which text it belongs to (its length in the first column)."""
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    out[:, 0] = [len(t) for t in texts]
    return out


def make(embed, store: RecordingStore, batch: int = 2, overlap: bool = True, write_behind: bool = True
         ) -> BatchCommitter:
    written: list[str] = []
    committer = BatchCommitter(store, embed, batch, ChunkStaging(None, "scope"),
                               lambda entry: written.append(entry.doc.key), Clock(), overlap=overlap,
                               write_behind=write_behind)
    committer.written = written  # type: ignore[attr-defined]
    return committer


def add_document(committer: BatchCommitter, key: str, texts: list[str]) -> int:
    doc = Document(key=key, source=key, text=" ".join(texts), content_hash=f"h-{key}", acl=frozenset({"public"}))
    committer.begin(doc, frozenset({"public"}), is_new=True)
    for i, text in enumerate(texts):
        committer.add(Chunk(key, i, text, len(text)))
    return committer.end()


def test_the_next_batch_is_read_while_one_is_embedded() -> None:
    # The embedder holds the first batch until the caller has queued chunks of the next one:
    # without overlap this could never happen (add would not return), so the wait times out.
    store = RecordingStore()
    queued_more = threading.Event()
    calls: list[list[str]] = []

    def embed(texts):
        calls.append(list(texts))
        if len(calls) == 1:
            assert queued_more.wait(timeout=20), "the ingest did not go on while the batch was embedded"
        return vectors_of(texts)

    committer = make(embed, store)
    add_document(committer, "a", ["a1", "a2"])
    committer.send()  # batch 1 to the embedder; send returns at once
    add_document(committer, "b", ["bb1"])
    assert committer.waiting == 1 and ("write", "a") not in store.events  # nothing written while batch 1 is out
    queued_more.set()
    committer.flush()
    committer.close()
    assert calls == [["a1", "a2"], ["bb1"]]
    writer = "ingest-write_0"
    # The caller's flush before the writer starts (its own open batch, if any), then the writer's.
    assert store.events == [("flush", None), ("write", "a"), ("flush", None), ("write", "b"), ("flush", None),
                            ("release", writer), ("release", writer)]  # flush's, then close's
    assert store.threads == {writer} and committer.written == ["a", "b"]
    np.testing.assert_array_equal(store.rows["a"][1][:, 0], [2, 2])


@pytest.mark.parametrize(("overlap", "write_behind"), [(True, True), (True, False), (False, False)])
def test_the_same_rows_with_and_without_overlap(overlap: bool, write_behind: bool) -> None:
    # Documents spanning batches (staged, then completed) come out whole and in order every way.
    store = RecordingStore()
    committer = make(vectors_of, store, batch=3, overlap=overlap, write_behind=write_behind)
    docs = {"a": ["a"] * 5, "b": ["bb"], "c": ["ccc"] * 4, "d": ["dddd"] * 2}
    for key, texts in docs.items():
        add_document(committer, key, texts)
        if committer.waiting >= 3:
            committer.send()
    committer.flush()
    committer.close()
    assert committer.written == list(docs)
    for key, texts in docs.items():
        assert store.rows[key][0] == texts
        np.testing.assert_array_equal(store.rows[key][1][:, 0], [len(t) for t in texts])
    assert committer.counts.chunks_embedded == sum(len(t) for t in docs.values())


def test_a_document_dropped_while_its_chunks_are_embedded_is_neither_written_nor_staged() -> None:
    store = RecordingStore()
    release = threading.Event()

    def embed(texts):
        release.wait(timeout=20)
        return vectors_of(texts)

    committer = make(embed, store, batch=2)
    doc = Document(key="x", source="x", text="", content_hash="h-x", acl=frozenset({"public"}))
    committer.begin(doc, frozenset({"public"}), is_new=True)
    committer.add(Chunk("x", 0, "x0", 2))
    committer.add(Chunk("x", 1, "x1", 2))
    committer.add(Chunk("x", 2, "x2", 2))  # the first two went to the embedder
    committer.abort()  # a later block of x failed to parse
    add_document(committer, "y", ["y0"])
    release.set()
    committer.flush()
    committer.close()
    assert committer.written == ["y"] and "x" not in store.rows
    assert committer.staging.staged("x", "h-x") == {}


@pytest.mark.parametrize("write_behind", [True, False])
def test_an_embedder_error_ends_the_run_and_close_does_not_hang(write_behind: bool) -> None:
    store = RecordingStore()

    def embed(texts):
        if "boom" in texts:
            raise RuntimeError("CUDA error: out of memory")
        return vectors_of(texts)

    committer = make(embed, store, batch=1, write_behind=write_behind)
    add_document(committer, "a", ["boom"])
    if not write_behind:
        committer.send()  # returns: the error is on the embed thread, and rises at the next batch
        add_document(committer, "b", ["fine"])
    with pytest.raises(RuntimeError, match="out of memory"):
        # With write-behind the writer meets it: it rises at this send if the writer got there
        # already, else at a later send, `poll` or the flush.
        committer.send()
        add_document(committer, "b", ["fine"])
        committer.send()
        committer.flush()
    committer.close()
    assert "a" not in store.rows and "b" not in store.rows  # nothing after the failed batch is written


def test_the_embed_clock_is_the_embedders_time_and_the_wait_is_its_own_stage() -> None:
    store = RecordingStore()

    def slow(texts):
        time.sleep(0.2)
        return vectors_of(texts)

    committer = make(slow, store, batch=1)
    add_document(committer, "a", ["a"])
    committer.flush()  # nothing else to do: the whole embedding is waited for
    committer.close()
    seconds = committer.clock.seconds
    # The wait starts a moment after the embed thread does: most, not all, of the 0.2 s.
    assert seconds["embed"] >= 0.2 and seconds["embed_wait"] >= 0.1 and "write" in seconds


def test_the_walk_goes_on_while_a_batch_is_written() -> None:
    # The store holds its first write until the caller has sent the next batch: if the caller
    # wrote (write_behind=False), it could not get there and the write would time out.
    store = RecordingStore()
    went_on = threading.Event()
    timed_out: list[str] = []
    original = store.replace_documents

    def replace_documents(writes):
        if not store.rows and not went_on.wait(timeout=20):
            timed_out.append(writes[0].doc.key)
        original(writes)

    store.replace_documents = replace_documents  # type: ignore[method-assign]
    committer = make(vectors_of, store, batch=1)
    add_document(committer, "a", ["a"])
    committer.send()
    add_document(committer, "b", ["b"])
    committer.send()  # returns while "a" is still being written
    went_on.set()
    committer.flush()
    committer.close()
    assert not timed_out and committer.written == ["a", "b"] and store.threads == {"ingest-write_0"}


def test_the_caller_waits_once_three_batches_are_behind() -> None:
    # Bounded memory (and what a kill loses): a stuck writer stops the caller after _MAX_BEHIND sends.
    from ingest.batch_commit import _MAX_BEHIND

    store = RecordingStore()
    release = threading.Event()
    original = store.replace_documents

    def replace_documents(writes):
        release.wait(timeout=20)
        original(writes)

    store.replace_documents = replace_documents  # type: ignore[method-assign]
    committer = make(vectors_of, store, batch=1)
    sent: list[int] = []

    def caller() -> None:
        for i in range(_MAX_BEHIND + 2):
            add_document(committer, f"d{i}", [f"text {i}"])
            committer.send()
            sent.append(i)

    thread = threading.Thread(target=caller)
    thread.start()
    deadline = time.monotonic() + 20
    while len(sent) < _MAX_BEHIND and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(sent) == _MAX_BEHIND and thread.is_alive()  # the next send waits for the writer
    release.set()
    thread.join(timeout=20)
    committer.flush()
    committer.close()
    assert len(sent) == _MAX_BEHIND + 2 and committer.written == [f"d{i}" for i in range(_MAX_BEHIND + 2)]


def test_a_store_write_between_documents_keeps_its_order_with_the_batches() -> None:
    store = RecordingStore()
    committer = make(vectors_of, store, batch=2)
    add_document(committer, "a", ["a"])
    committer.store_write(store.set_acl, "old", frozenset({"nobody"}))  # after "a" was queued
    add_document(committer, "b", ["b"])
    committer.flush()
    committer.close()
    writes = [e for e in store.events if e[0] in ("write", "acl")]
    # "a" and "b" share one batch, embedded after the ACL change was asked for: the change comes
    # first, as it did when the caller wrote it at once; all of it on the writer thread.
    assert writes == [("acl", "old"), ("write", "a"), ("write", "b")] and store.threads == {"ingest-write_0"}


def test_a_failed_write_ends_the_run_keeps_the_batches_before_it_and_closes_the_writer() -> None:
    store = RecordingStore()
    original = store.replace_documents

    def replace_documents(writes):
        if any(w.doc.key == "bad" for w in writes):
            raise OSError("disk full")
        original(writes)

    store.replace_documents = replace_documents  # type: ignore[method-assign]
    committer = make(vectors_of, store, batch=1)
    with pytest.raises(OSError, match="disk full"):
        for key in ("a", "bad", "c", "d"):
            add_document(committer, key, [key])
            committer.send()
        committer.flush()
    committer.close()
    assert committer.written == ["a"] and "c" not in store.rows and "d" not in store.rows
    # Flushed after the failure too (the batches before it are whole), and the writer let go of the store.
    assert store.events[-1] == ("release", "ingest-write_0") and ("flush", None) in store.events[1:]


def test_the_writer_threads_catalog_connection_is_closed_after_each_run(tmp_path, tokenizer) -> None:
    # A long-lived Rag ingests many times: each run's writer thread must not leave a connection
    # (and with it, an open write transaction) behind in the catalog.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / ".rag-acl.toml").write_text('allow = ["public"]\n')
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("c", "fake", "fp", 8, ChunkingConfig().as_dict())
    store = EmbeddedCollection(catalog, info, tmp_path / "indexes")
    open_before = len(catalog._conns._all)
    for run in range(3):
        (corpus / f"doc{run}.md").write_text(f"# Doc {run}\n\nabout pipettes and centrifuges, run {run}\n")
        pipeline = IngestPipeline(store, fake_embed, Chunker(tokenizer, ChunkingConfig()), batch_chunks=1)
        report = pipeline.run([corpus])
        assert report.added == 1 and len(catalog._conns._all) == open_before
    assert catalog.collection_stats("c")["documents"] == 3
    catalog.close()


@pytest.mark.slow
def test_lab_docs_store_the_same_rows_with_and_without_overlap(tokenizer, tmp_path) -> None:
    pytest.importorskip("unstructured")
    from tests.ingest.test_parse_pool import LAB_DOCS, _broken_corpus

    corpus = tmp_path / "corpus"
    shutil.copytree(LAB_DOCS, corpus)
    _broken_corpus(corpus)
    runs = []
    for overlap, write_behind in ((True, True), (True, False), (False, False)):
        catalog = Catalog(tmp_path / f"catalog-{overlap}-{write_behind}.sqlite")
        info = catalog.create_collection("c", "fake", "fp", 8, ChunkingConfig().as_dict())
        store = EmbeddedCollection(catalog, info, tmp_path / f"indexes-{overlap}-{write_behind}")
        # Small embed batches, so documents span batches and are staged while others are embedded.
        pipeline = IngestPipeline(store, fake_embed, Chunker(tokenizer, ChunkingConfig()), batch_chunks=5,
                                  chunk_batch=8, overlap_embedding=overlap, write_behind=write_behind)
        report = pipeline.run([corpus])
        rows = [{k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in r.items()} for r in catalog.dump("c")]
        catalog.close()
        runs.append((rows, [(p.key, p.reason) for p in report.problems], report.chunks_embedded))
    assert len(runs[0][0]) > 50 and runs[0][1]
    assert runs[1] == runs[0] and runs[2] == runs[0]  # rows (texts, ACLs, vectors), problems and chunk counts


def test_the_setting_reaches_the_committer_of_rag_ingest(tmp_path, monkeypatch) -> None:
    from ingest import pipeline as ingest_pipeline
    from rag.pipeline import Rag
    from rag.settings import Settings

    seen: list[bool] = []

    class Spy(BatchCommitter):
        def __init__(self, *args, overlap: bool = True, **kwargs) -> None:
            seen.append(overlap)
            super().__init__(*args, overlap=overlap, **kwargs)

    monkeypatch.setattr(ingest_pipeline, "BatchCommitter", Spy)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.md").write_text("# A\n\nsome text about pipettes\n")
    (corpus / ".rag-acl.toml").write_text('allow = ["public"]\n')
    for value in (False, True):
        rag = Rag(Settings(home=tmp_path / f"home-{value}", ingest_overlap_embedding=value))
        try:
            report = rag.ingest([corpus])
        finally:
            rag.close()
        assert report.added == 1
    assert seen == [False, True]


def test_the_gil_switch_interval_is_short_while_the_embed_thread_runs_and_restored_after() -> None:
    # The embed thread's short GPU launches would wait up to the default 5 ms each for the GIL
    # while this thread chunks and writes (rag/switch_interval.py): overlap lowers it, close restores.
    before = sys.getswitchinterval()
    seen: list[float] = []

    def embed(texts):
        seen.append(sys.getswitchinterval())
        return vectors_of(texts)

    try:
        sys.setswitchinterval(0.005)
        for overlap in (True, False):
            seen.clear()
            committer = make(embed, RecordingStore(), overlap=overlap)
            add_document(committer, "a", ["a1", "a2", "a3"])
            committer.flush()
            expected = OVERLAP_SWITCH_INTERVAL_MS / 1000 if overlap else 0.005  # as sys stores it: microseconds
            assert seen and all(abs(s - expected) < 1e-7 for s in seen), (overlap, seen)
            committer.close()
            assert abs(sys.getswitchinterval() - 0.005) < 1e-7
            committer.close()  # twice: nothing more to restore
            assert abs(sys.getswitchinterval() - 0.005) < 1e-7
    finally:
        sys.setswitchinterval(before)


def test_store_writes_alone_are_all_made_by_the_flush() -> None:
    # A run that only changes ACLs (every document unchanged) sends no batch: the flush must still
    # wait for every write it queued, not just the batches.
    store = RecordingStore()
    committer = make(vectors_of, store)
    for key in ("a", "b", "c"):
        committer.store_write(store.set_acl, key, frozenset({"user:carl"}))
    committer.flush()
    committer.close()
    assert [e for e in store.events if e[0] == "acl"] == [("acl", "a"), ("acl", "b"), ("acl", "c")]


def test_the_callers_open_batch_is_committed_before_the_writer_writes(tmp_path) -> None:
    # A shard seeded from the collection leaves its last batch open on the caller's connection
    # (BEGIN IMMEDIATE): the writer thread's first write would wait for that lock until it timed out.
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("c", "fake", "fp", DIM, ChunkingConfig().as_dict())
    store = EmbeddedCollection(catalog, info, tmp_path / "indexes")
    store.batch_writes = True  # as ingest opens it
    seeded = Document(key="seeded", source="seeded", text="s", content_hash="h-s", acl=frozenset({"public"}))
    store.replace_document(seeded, frozenset({"public"}), [Chunk("seeded", 0, "s", 1)], vectors_of(["s"]))
    assert catalog.conn.in_transaction  # the caller's batch is open
    committer = BatchCommitter(store, vectors_of, 1, ChunkStaging(None, "scope"), lambda entry: None, Clock())
    add_document(committer, "new", ["fresh text"])
    committer.flush()
    committer.close()
    assert catalog.collection_stats("c")["documents"] == 2
    catalog.close()
