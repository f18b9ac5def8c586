"""Contract suite at the collection level: every backend behaves like the numpy reference.

Backends: the SQLite catalog with each vector index (memory = the reference, Faiss flat,
HNSW, IVF) and PostgreSQL with pgvector (a real throwaway server). HNSW and IVF also run
with `exact_below=0` ("...:approx"), so the graph and the inverted lists themselves are
searched rather than the exact path these small collections otherwise take. The stores an
ingest writes to during a versioned rebuild ("...:build": the next version of a collection
built with other settings, `retrieval.rebuild.CollectionBuild`) are collection stores too,
and run the same suite, as does what an ingest opens for a new pgvector collection
("pgvector:bulk": writes batched several documents per transaction, no HNSW index until the
load ends). The reference
answer is computed here from what was written, independently of any store: for a principal's
tokens, the chunks of documents whose ACL names one of them, ranked by inner product.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from rag.errors import NotFoundError, StoreError
from rag.types import Chunk, Document
from retrieval.rebuild import CollectionBuild
from retrieval.records import BuildSpec, DocumentWrite
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from retrieval.vectors.faiss_ann import HnswIndex, IvfIndex

DIM = 16
CATALOG_KINDS = ["memory", "faiss", "faiss-hnsw", "faiss-ivf", "faiss-hnsw:approx", "faiss-ivf:approx"]
BACKENDS = [*CATALOG_KINDS, "pgvector", "pgvector:bulk", "faiss:build", "pgvector:build"]
CHUNKING = {"max_tokens": 64, "overlap_tokens": 0}
GROUPS = [f"group:g{i}" for i in range(6)] + ["public", "user:alice", "user:bob"]


def _open(kind: str, tmp_path, request):
    kind, _, mode = kind.partition(":")
    if mode == "build":
        return _open_build(kind, tmp_path, request)
    if kind == "pgvector" and mode == "bulk":
        # What an ingest writes to: batched writes, a new collection loaded without its HNSW index.
        from retrieval.stores.pgvector.rebuild import open_for_ingest

        store = open_for_ingest(request.getfixturevalue("pg_dsn"), "contract",
                                BuildSpec("test-embedder", "fp-1", DIM, CHUNKING), batch_documents=7)
        request.addfinalizer(store.close)
        return store
    if kind == "pgvector":
        from retrieval.stores.pgvector.collection import create_collection

        return create_collection(request.getfixturevalue("pg_dsn"), "contract", "test-embedder", "fp-1", DIM,
                                 CHUNKING)
    catalog = Catalog(tmp_path / "catalog.sqlite")
    info = catalog.create_collection("contract", "test-embedder", "fp-1", DIM, CHUNKING)
    return EmbeddedCollection(catalog, info, tmp_path / "indexes", kind,
                              exact_below=0 if mode == "approx" else None)


def _open_build(kind: str, tmp_path, request):
    """The next version of collection "contract", whose live version was built with other chunking."""
    from retrieval.stores import CollectionStores

    def catalog() -> Catalog:
        return Catalog(tmp_path / "catalog.sqlite")

    opened = catalog()
    stores = CollectionStores(kind, lambda: opened, tmp_path / "indexes",
                              lambda: request.getfixturevalue("pg_dsn"))
    stores.for_ingest("contract", BuildSpec("test-embedder", "fp-1", DIM, {"max_tokens": 32, "overlap_tokens": 0}))
    build = stores.for_ingest("contract", BuildSpec("test-embedder", "fp-1", DIM, CHUNKING))
    assert isinstance(build, CollectionBuild) and build.notice
    request.addfinalizer(opened.close)
    request.addfinalizer(stores.close)
    request.addfinalizer(lambda: getattr(build.build, "close", lambda: None)())
    build.stores = stores  # for the test of finishing it
    return build


def _approximate_store(store) -> HnswIndex | IvfIndex | None:
    """The vector store of a backend that searches its graph / lists on every query, else None."""
    vectors = getattr(store, "vectors", None)
    if isinstance(vectors, HnswIndex | IvfIndex) and vectors.exact_below == 0:
        return vectors
    return None


def _assert_matches_reference(store, got, want, counts: list[int]) -> None:
    """A default-mode search: exactly the reference, or for an approximate one, counted for recall.

    Every backend but the "...:approx" ones searches these collections exactly: memory and Faiss
    flat always, HNSW / IVF below their `exact_below` threshold, pgvector for principals who
    may read at most its `exact_below` chunks. `counts` gathers [found, relevant].
    """
    if _approximate_store(store) is None:
        _assert_same(got, want)
    counts[0] += len({loc for loc, _ in got} & {loc for loc, _ in want})
    counts[1] += len(want)


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    return _open(request.param, tmp_path, request)


class Corpus:
    """What was written, kept independently of the store to compute reference answers."""

    def __init__(self, store, seed: int = 0) -> None:
        self.store = store
        self.rng = np.random.default_rng(seed)
        self.docs: dict[str, tuple[frozenset[str], list[str], np.ndarray]] = {}

    def write(self, key: str, n_chunks: int, acl: frozenset[str] | None = None,
              texts: list[str] | None = None) -> None:
        if acl is None:
            acl = frozenset(self.rng.choice(GROUPS, size=int(self.rng.integers(1, 3)), replace=False).tolist())
        w = self._make(key, n_chunks, acl, texts)
        self.store.replace_document(*w)
        self.docs[key] = (acl, [c.text for c in w.chunks], w.vectors)

    def write_many(self, specs: list[tuple[str, int, frozenset[str], list[str] | None]]) -> None:
        """Several documents in one `replace_documents` call (as ingest writes an embed batch's)."""
        writes = []
        for key, n_chunks, acl, texts in specs:
            writes.append(self._make(key, n_chunks, acl, texts))
            self.docs[key] = (acl, [c.text for c in writes[-1].chunks], writes[-1].vectors)
        self.store.replace_documents(writes)

    def _make(self, key: str, n_chunks: int, acl: frozenset[str], texts: list[str] | None) -> DocumentWrite:
        texts = texts or [f"{key} part {i} " + " ".join(self.rng.choice(WORDS, size=8).tolist())
                          for i in range(n_chunks)]
        vecs = self.rng.standard_normal((len(texts), DIM)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        body = "\n".join(texts)
        doc = Document(key=key, source=f"/lab/{key}.md", text=body,
                       content_hash=hashlib.sha256(body.encode()).hexdigest(), acl=acl, title=key)
        chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split())) for i, t in enumerate(texts)]
        return DocumentWrite(doc, acl, chunks, vecs)

    def set_acl(self, key: str, acl: frozenset[str]) -> None:
        self.store.set_acl(key, acl)
        self.docs[key] = (acl, *self.docs[key][1:])

    def delete(self, key: str) -> None:
        self.store.delete_document(key)
        self.docs.pop(key, None)

    def expected(self, query: np.ndarray, k: int, tokens) -> list[tuple[tuple[str, int], float]]:
        rows = []
        for key, (acl, _, vecs) in self.docs.items():
            if acl & set(tokens):
                rows += [((key, i), float(v @ query)) for i, v in enumerate(vecs)]
        rows.sort(key=lambda r: -r[1])
        return rows[:k]

    def located(self, hits: list[tuple[int, float]], store=None) -> list[tuple[tuple[str, int], float]]:
        records = (store or self.store).chunk_records([i for i, _ in hits])
        return [((records[i].document_key, records[i].index), s) for i, s in hits]


WORDS = ["sample", "buffer", "freezer", "cluster", "node", "queue", "protocol", "reagent",
         "microscope", "sequencer", "storage", "backup", "quota", "partition", "pipeline"]


def _query(rng) -> np.ndarray:
    q = rng.standard_normal(DIM).astype(np.float32)
    return q / np.linalg.norm(q)


def _assert_same(got, want) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    assert np.allclose([g[1] for g in got], [w[1] for w in want], atol=1e-4)


def test_exact_filtered_topk_matches_reference(store):
    corpus = Corpus(store)
    for d in range(60):
        corpus.write(f"doc{d:02d}", int(corpus.rng.integers(1, 5)))
    rng = np.random.default_rng(1)
    for trial in range(25):
        tokens = rng.choice(GROUPS, size=int(rng.integers(1, 4)), replace=False).tolist()
        q, k = _query(rng), int(rng.integers(1, 25))
        got = corpus.located(store.search(q, k, tokens, exact=True))
        _assert_same(got, corpus.expected(q, k, tokens))
        # the default (possibly approximate) path never returns anything outside the filter
        default = corpus.located(store.search(q, k, tokens))
        for (key, _), _ in default:
            assert corpus.docs[key][0] & set(tokens), trial
        if _approximate_store(store) is None:  # and where it is exact, it is the reference
            _assert_same(default, got)


@pytest.mark.slow
def test_filtered_topk_after_deletes_and_acl_changes(store):
    """Enough chunks that IVF trains, then deletes that compact HNSW / IVF (1200 chunks left)."""
    corpus = Corpus(store, seed=13)
    for d in range(65):
        corpus.write(f"doc{d:02d}", 40)
    rng = np.random.default_rng(14)

    def check(trials: int) -> None:
        counts = [0, 0]  # found, relevant
        for trial in range(trials):
            tokens = rng.choice(GROUPS, size=int(rng.integers(1, 4)), replace=False).tolist()
            q, k = _query(rng), int(rng.integers(1, 25))
            want = corpus.expected(q, k, tokens)
            _assert_same(corpus.located(store.search(q, k, tokens, exact=True)), want)
            got = corpus.located(store.search(q, k, tokens))
            assert all(corpus.docs[key][0] & set(tokens) for (key, _), _ in got), trial
            assert len(got) == len(want), trial
            _assert_matches_reference(store, got, want, counts)
        if _approximate_store(store) is not None:  # the others matched the reference exactly
            assert counts[0] / counts[1] >= 0.9

    def check_paths(searches: int) -> None:
        ann = _approximate_store(store)
        if ann is not None:  # every default-mode search went to the graph / lists
            assert ann.num_approximate_searches == searches  # fallbacks included
            assert ann.num_exact_searches == searches  # the exact=True ones only
            assert not isinstance(ann, IvfIndex) or ann.index.is_trained
            assert ann.index.ntotal == ann.count()  # after the deletes: HNSW was rebuilt (compacted)

    check(15)
    check_paths(15)
    for d in range(35):
        corpus.delete(f"doc{d:02d}")
    for d in range(35, 45):
        corpus.set_acl(f"doc{d:02d}", frozenset({GROUPS[d % 3]}))
    assert store.stats() == {"documents": 30, "chunks": 1200}
    check(15)
    check_paths(30)


def test_replace_delete_and_stats(store):
    corpus = Corpus(store, seed=2)
    corpus.write("a", 4, frozenset({"public"}))
    corpus.write("b", 2, frozenset({"public"}))
    assert store.stats() == {"documents": 2, "chunks": 6}
    corpus.write("a", 1, frozenset({"public"}))  # re-ingest with fewer chunks: old ones go
    assert store.stats() == {"documents": 2, "chunks": 3}
    q = _query(np.random.default_rng(3))
    got = corpus.located(store.search(q, 10, ["public"], exact=True))
    assert sorted(loc for loc, _ in got) == [("a", 0), ("b", 0), ("b", 1)]
    _assert_same(got, corpus.expected(q, 10, ["public"]))
    corpus.delete("a")
    corpus.delete("never-there")  # no-op
    assert store.stats() == {"documents": 1, "chunks": 2}
    assert set(store.document_states()) == {"b"}
    assert {loc[0] for loc, _ in corpus.located(store.search(q, 10, ["public"]))} == {"b"}


def test_documents_written_together_read_like_documents_written_one_by_one(store):
    # What ingest writes after each embed batch: new documents, new versions of stored ones (old
    # chunks gone, under the new ACL only), the same document twice; every reader sees the reference.
    corpus = Corpus(store, seed=13)
    corpus.write("kept", 2, frozenset({"group:g0"}))
    corpus.write("shrinks", 3, frozenset({"group:g1"}))
    corpus.write("moves", 2, frozenset({"group:g2"}))
    corpus.write_many([
        ("shrinks", 1, frozenset({"group:g1"}), None),
        ("new1", 2, frozenset({"group:g2", "user:alice"}), None),
        ("moves", 2, frozenset({"group:g3"}), ["moves part 0 QOSMaxGRESPerJob", "moves part 1 sample"]),
        ("new2", 1, frozenset({"public"}), None),
    ])
    corpus.write_many([("twice", 2, frozenset({"group:g4"}), None), ("twice", 1, frozenset({"group:g5"}), None)])
    assert store.stats() == {"documents": 6, "chunks": 2 + 1 + 2 + 2 + 1 + 1}
    rng = np.random.default_rng(14)
    for tokens in (["group:g0"], ["group:g1"], ["group:g2"], ["group:g3", "user:bob"], ["user:alice"],
                   ["public"], ["group:g4"], ["group:g5"]):
        q = _query(rng)
        _assert_same(corpus.located(store.search(q, 10, tokens, exact=True)), corpus.expected(q, 10, tokens))
    assert store.search(_query(rng), 10, ["group:g4"]) == []  # the first "twice" was replaced whole
    # The moved document's words are searchable under its new ACL only.
    assert store.keyword_search("QOSMaxGRESPerJob", 5, ["group:g2"]) == []
    assert [loc for loc, _ in corpus.located(store.keyword_search("QOSMaxGRESPerJob", 5, ["group:g3"]))] == \
        [("moves", 0)]
    assert store.document_states()["moves"].acl == frozenset({"group:g3"})


def test_acl_change_moves_visibility_without_touching_vectors(store):
    corpus = Corpus(store, seed=4)
    corpus.write("secret", 3, frozenset({"group:g1"}))
    corpus.write("open", 2, frozenset({"public"}))
    before = {(r["key"], r["index"]): r["vector"] for r in store.dump()}
    q = _query(np.random.default_rng(5))
    assert {loc[0] for loc, _ in corpus.located(store.search(q, 10, ["group:g2", "public"]))} == {"open"}
    corpus.set_acl("secret", frozenset({"group:g2"}))
    assert {loc[0] for loc, _ in corpus.located(store.search(q, 10, ["group:g2", "public"]))} == {"secret", "open"}
    assert store.search(q, 10, ["group:g1"]) == []
    assert store.document_states()["secret"].acl == frozenset({"group:g2"})
    after = {(r["key"], r["index"]): r["vector"] for r in store.dump()}
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with pytest.raises(NotFoundError):
        store.set_acl("missing", frozenset({"public"}))


def test_empty_collection_and_empty_filter(store):
    q = _query(np.random.default_rng(6))
    assert store.stats() == {"documents": 0, "chunks": 0}
    assert store.search(q, 5, ["public"]) == []
    assert store.keyword_search("freezer", 5, ["public"]) == []
    corpus = Corpus(store, seed=7)
    corpus.write("a", 3, frozenset({"public"}))
    # an empty filter means "nothing", never "everything"
    assert store.search(q, 5, []) == []
    assert store.keyword_search("freezer sample node", 5, []) == []


def test_k_larger_than_allowed_returns_all_allowed(store):
    corpus = Corpus(store, seed=8)
    for d in range(30):
        corpus.write(f"d{d}", 3, frozenset({"group:g0"}))
    corpus.write("mine", 2, frozenset({"user:alice"}))
    q = _query(np.random.default_rng(9))
    got = corpus.located(store.search(q, 50, ["user:alice"]))
    assert sorted(loc for loc, _ in got) == [("mine", 0), ("mine", 1)]


def test_dimension_mismatch_is_a_clear_error(store):
    doc = Document(key="x", source="/x", text="x", content_hash="h", acl=frozenset({"public"}))
    chunk = Chunk(document_key="x", index=0, text="x", num_tokens=1)
    with pytest.raises(StoreError, match=str(DIM)):
        store.replace_document(doc, frozenset({"public"}), [chunk], np.ones((1, DIM + 3), dtype=np.float32))
    assert store.stats()["documents"] == 0  # nothing half-written
    with pytest.raises(StoreError):
        store.search(np.ones(DIM + 1, dtype=np.float32), 3, ["public"])


def test_keyword_search_is_filtered_inside_the_query(store):
    corpus = Corpus(store, seed=10)
    # Many unreadable chunks match the identifier strongly; three readable ones weakly.
    for d in range(40):
        corpus.write(f"hidden{d}", 1, frozenset({"group:g5"}),
                     texts=["QOSMaxGRESPerJob QOSMaxGRESPerJob error on gpu-a100-03"])
    for d in range(3):
        corpus.write(f"mine{d}", 1, frozenset({"user:bob"}),
                     texts=[f"a long note about many things {d}, once mentioning QOSMaxGRESPerJob "
                            "among storage quota backup partition pipeline words"])
    got = corpus.located(store.keyword_search("Why QOSMaxGRESPerJob?", 5, ["user:bob", "public"]))
    assert sorted(loc[0] for loc, _ in got) == ["mine0", "mine1", "mine2"]
    assert all(s1 >= s2 for (_, s1), (_, s2) in zip(got, got[1:], strict=False))
    assert len(store.keyword_search("QOSMaxGRESPerJob", 5, ["group:g5"])) == 5
    assert store.keyword_search("QOSMaxGRESPerJob", 5, ["group:g0"]) == []
    # query syntax is never interpreted: these are just words
    for nasty in ['"QOSMaxGRESPerJob" OR NOT x*', "NEAR(a b", "' ; DROP TABLE x; --", "&|!():*"]:
        for (key, _), _ in corpus.located(store.keyword_search(nasty, 10, ["user:bob"])):
            assert key.startswith("mine")


def test_chunk_records_carry_what_hits_need(store):
    corpus = Corpus(store, seed=11)
    corpus.write("rec", 2, frozenset({"group:g3", "user:alice"}), texts=["first text", "second text"])
    hits = store.search(_query(np.random.default_rng(12)), 2, ["user:alice"])
    records = store.chunk_records([i for i, _ in hits])
    assert {r.text for r in records.values()} == {"first text", "second text"}
    for r in records.values():
        assert r.document_key == "rec" and r.source == "/lab/rec.md" and r.title == "rec"
        assert r.acl == frozenset({"group:g3", "user:alice"})


@pytest.mark.parametrize("kind", ["faiss:build", "pgvector:build"])
def test_a_finished_build_is_what_queries_read(kind, tmp_path, request):
    """What ingest does at the end of a rebuild: save, finish, and the live collection is the build."""
    build = _open(kind, tmp_path, request)
    corpus = Corpus(build)
    for d in range(12):
        corpus.write(f"doc{d:02d}", int(corpus.rng.integers(1, 4)))
    build.save()
    outcome = build.finish()
    assert outcome is not None and outcome.switched and outcome.generation == 2
    live = build.stores.open("contract")
    live.refresh()
    chunks = sum(len(texts) for _, texts, _ in corpus.docs.values())
    assert live.info.chunking == CHUNKING and live.stats() == {"documents": 12, "chunks": chunks}
    rng = np.random.default_rng(3)
    for _ in range(5):
        tokens = rng.choice(GROUPS, size=2, replace=False).tolist()
        q = _query(rng)
        _assert_same(corpus.located(live.search(q, 8, tokens, exact=True), live), corpus.expected(q, 8, tokens))


def test_a_plain_collection_has_nothing_to_finish(store):
    if isinstance(store, CollectionBuild):
        pytest.skip("not applicable: a rebuild; finishing one is the test above")
    Corpus(store).write("doc", 2)
    store.save()
    assert store.notice is None and store.finish() is None
