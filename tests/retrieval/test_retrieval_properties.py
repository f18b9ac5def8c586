"""Property-based leak tests of every store and retrieval mode, through the store API.

A state machine adds, edits, re-permissions and deletes documents with random ACLs through one
store object (the writer, like an ingest job) and queries through another over the same data
(the reader, like a query server) after `refresh()`, as the next request would. After every
step, for random principals and queries (exact phrases and marker words of unreadable and
deleted text among them), each backend's dense search (exact and default), keyword search and
the Retriever's dense / keyword / hybrid modes must return only readable chunks with their
current text and ACL; the exact search must return every readable chunk (the filter runs
inside the search, not after a global top-k). A second property checks non-interference:
what a principal gets (ids, order, scores) is the same whether or not unreadable documents exist.

The embedder is `fuzz_corpus.hash_embed` (bag of hashed words): no model is needed, and a
query that is an unreadable chunk's text points straight at that chunk.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from permissions.models import Principal
from permissions.policy import store_filter
from rag.types import Chunk, Document
from retrieval.retriever import MODES, Retriever
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from tests.fuzz_corpus import DIM, Reference, acls, chunk_texts, hash_embed, marker, principals, queries, scaled

CHUNKING = {"max_tokens": 64, "overlap_tokens": 0}
# memory is the reference; ":approx" searches the HNSW graph / IVF lists even for tiny allow-lists.
CATALOG_BACKENDS = ["memory", "faiss", "faiss-hnsw:approx", "faiss-ivf:approx"]
BACKENDS = [*CATALOG_BACKENDS, "pgvector", "pgvector:approx"]
ALL = 10_000  # a k larger than any corpus here: "every readable chunk"


class Backend:
    """A writer and a reader over the same collection of one backend, in a private place."""

    def __init__(self, kind: str, pg_server=None, name: str = "fuzz") -> None:
        self.kind = kind
        self._stack = contextlib.ExitStack()
        base, _, mode = kind.partition(":")
        if base == "pgvector":
            from retrieval.stores.pgvector.collection import create_collection, open_collection
            from tests.pg_fixture import fresh_database

            dsn = self._stack.enter_context(fresh_database(pg_server))
            tuning = {"exact_below": 0} if mode == "approx" else {}
            self.writer = create_collection(dsn, name, "hash-embed", "fp", DIM, CHUNKING, **tuning)
            self.reader = open_collection(dsn, name, **tuning)
            self._stack.callback(self.writer.close)
            self._stack.callback(self.reader.close)
            return
        tmp = Path(tempfile.mkdtemp(prefix="fuzz-store-"))
        self._stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        exact_below = 0 if mode == "approx" else None
        wcat = Catalog(tmp / "catalog.sqlite")
        info = wcat.create_collection(name, "hash-embed", "fp", DIM, CHUNKING)
        self.writer = EmbeddedCollection(wcat, info, tmp / "indexes", base, exact_below=exact_below)
        rcat = Catalog(tmp / "catalog.sqlite")
        self.reader = EmbeddedCollection(rcat, rcat.get_collection(name), tmp / "indexes", base,
                                      exact_below=exact_below)
        self._stack.callback(wcat.close)
        self._stack.callback(rcat.close)

    def close(self) -> None:
        self._stack.close()

    def write(self, key: str, acl: frozenset[str], texts: list[str]) -> None:
        body = "\n".join(texts)
        doc = Document(key=key, source=f"/lab/{key}.md", text=body, title=key, acl=acl,
                       content_hash=hashlib.sha256(body.encode()).hexdigest())
        chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=len(t.split()))
                  for i, t in enumerate(texts)]
        self.writer.replace_document(doc, acl, chunks, hash_embed(texts))


def located(store, found: list[tuple[int, float]]) -> list[tuple[str, int]]:
    records = store.chunk_records([i for i, _ in found])
    assert set(records) == {i for i, _ in found}, "a search returned an id with no chunk"
    return [(records[i].document_key, records[i].index) for i, _ in found]


def check_records(ref: Reference, principal: Principal, store, ids: list[int], what: str) -> None:
    """Every returned chunk is readable, current, and shows its current ACL and text."""
    records = store.chunk_records(ids)
    for i in ids:
        rec = records[i]
        doc = ref.docs.get(rec.document_key)
        assert doc is not None, f"{what}: chunk of a deleted document {rec.document_key}"
        assert principal.can_read(doc.acl), f"{what}: {principal} got {rec.document_key} (acl {sorted(doc.acl)})"
        assert rec.acl == doc.acl, f"{what}: stale ACL {sorted(rec.acl)} for {rec.document_key}"
        assert rec.text == doc.texts[rec.index], f"{what}: stale text for {rec.document_key}"
    leaked = ref.leaks(principal, [records[i].text for i in ids])
    assert not leaked, f"{what}: {principal} saw {leaked}"


def check_everything(ref: Reference, backend: Backend, principal: Principal, question: str, k: int) -> None:
    store = backend.reader
    store.refresh()  # what the next request does first (Retriever.retrieve does it too)
    tokens = sorted(store_filter(principal))
    readable = ref.readable_chunks(principal)
    q = hash_embed([question])[0]

    everything = store.search(q, ALL, tokens, exact=True)
    assert set(located(store, everything)) == readable, "exact search: not exactly the readable chunks"
    check_records(ref, principal, store, [i for i, _ in everything], "exact search")
    assert store.search(q, ALL, [], exact=True) == [], "no tokens must match nothing"

    for what, found in [("search", store.search(q, k, tokens)),
                        ("keyword", store.keyword_search(question, k, tokens)),
                        ("keyword, all", store.keyword_search(question, ALL, tokens))]:
        assert len(found) <= k or what == "keyword, all"
        assert set(located(store, found)) <= readable, what
        check_records(ref, principal, store, [i for i, _ in found], what)
    assert store.keyword_search(question, ALL, []) == []

    retriever = Retriever(store, lambda text: hash_embed([text])[0])
    for mode in MODES:
        hits = retriever.retrieve(question, principal, k=k, rerank=False, mode=mode).hits
        assert len(hits) <= k
        check_records(ref, principal, store, [h.chunk_id for h in hits], f"retriever {mode}")
        assert not ref.leaks(principal, [h.text for h in hits] + [h.title or "" for h in hits])
        assert all(h.acl == ref.docs[h.document_key].acl for h in hits)


class StoreMachine(RuleBasedStateMachine):
    """Random writes through the writer; after each, random questions through the reader."""

    KIND = "memory"
    PG_SERVER = None

    def __init__(self) -> None:
        super().__init__()
        self.backend = Backend(self.KIND, self.PG_SERVER)
        self.ref = Reference()
        self.next_doc = 0
        self.versions: dict[str, int] = {}

    def teardown(self) -> None:
        self.backend.close()

    def _keys(self) -> list[str]:
        return sorted(self.ref.docs)

    @initialize(data=st.data())
    def seed_corpus(self, data) -> None:
        for _ in range(data.draw(st.integers(1, 6), label="initial documents")):
            self.add(data)

    @rule(data=st.data())
    def add(self, data) -> None:
        n = self.next_doc
        self.next_doc += 1
        key = f"doc{n}"
        acl = data.draw(acls, label="acl")
        mark = marker(n, 0)
        texts = chunk_texts(data.draw, mark)
        self.backend.write(key, acl, texts)
        self.versions[key] = 0
        self.ref.put(key, acl, texts, mark)
        self._ask(data)

    @rule(data=st.data())
    def edit(self, data) -> None:
        if not self.ref.docs:
            return
        key = data.draw(st.sampled_from(self._keys()), label="edit")
        self.versions[key] += 1
        mark = marker(int(key[3:]), self.versions[key])
        acl = data.draw(st.one_of(st.just(self.ref.docs[key].acl), acls), label="acl")
        texts = chunk_texts(data.draw, mark)
        self.backend.write(key, acl, texts)
        self.ref.put(key, acl, texts, mark)
        self._ask(data)

    @rule(data=st.data())
    def repermission(self, data) -> None:
        if not self.ref.docs:
            return
        key = data.draw(st.sampled_from(self._keys()), label="set_acl")
        acl = data.draw(acls, label="acl")
        self.backend.writer.set_acl(key, acl)
        doc = self.ref.docs[key]
        self.ref.put(key, acl, doc.texts, doc.mark)
        self._ask(data)  # a narrowed ACL holds from the very next request

    @rule(data=st.data())
    def delete(self, data) -> None:
        if not self.ref.docs:
            self.backend.writer.delete_document("never-stored")  # a no-op, not an error
            return
        key = data.draw(st.sampled_from(self._keys()), label="delete")
        self.backend.writer.delete_document(key)
        self.ref.delete(key)
        self._ask(data)

    @rule(data=st.data())
    def save(self, data) -> None:
        self.backend.writer.save()
        self._ask(data)

    def _ask(self, data) -> None:
        """The checks after every step: random principals and questions through the reader."""
        for _ in range(2):
            principal = data.draw(principals, label="principal")
            question = data.draw(queries(self.ref), label="question")
            k = data.draw(st.sampled_from([1, 3, 10]), label="k")
            check_everything(self.ref, self.backend, principal, question, k)

    @invariant()
    def writer_and_reader_agree_on_states(self) -> None:
        self.backend.reader.refresh()
        states = self.backend.reader.document_states()
        assert {k: s.acl for k, s in states.items()} == {k: d.acl for k, d in self.ref.docs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", BACKENDS)
def test_no_store_shows_what_it_should_not(kind, request):
    pg = request.getfixturevalue("pg_server") if kind.startswith("pgvector") else None
    machine = type(f"StoreMachine_{kind.replace('-', '_').replace(':', '_')}", (StoreMachine,),
                   {"KIND": kind, "PG_SERVER": pg})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=scaled(6, 150), stateful_step_count=scaled(8, 25), deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))


# --------------------------------------------------------------------------- non-interference


@st.composite
def split_corpus(draw):
    """A principal, and documents in write order, each marked readable by them or not."""
    principal = draw(principals)
    docs = []
    for n in range(draw(st.integers(1, 10))):
        acl = draw(acls)
        docs.append((f"doc{n}", acl, chunk_texts(draw, marker(n, 0))))
    return principal, docs


@pytest.mark.parametrize("kind", ["faiss", "pgvector"])
@settings(max_examples=scaled(8, 200), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@pytest.mark.slow
@given(case=split_corpus(), data=st.data())
def test_unreadable_documents_change_nothing_a_principal_gets(kind, request, case, data):
    """Results, their order and their scores are the same with and without the unreadable documents:
    nothing a principal gets (keyword statistics included) depends on text they may not read."""
    principal, docs = case
    pg = request.getfixturevalue("pg_server") if kind == "pgvector" else None
    full, readable_only = Backend(kind, pg), Backend(kind, pg)
    try:
        ref = Reference()
        for key, acl, texts in docs:
            full.write(key, acl, texts)
            ref.put(key, acl, texts, marker(int(key[3:]), 0))
            if principal.can_read(acl):
                readable_only.write(key, acl, texts)
        full.reader.refresh()
        readable_only.reader.refresh()
        tokens = sorted(store_filter(principal))
        for _ in range(3):
            question = data.draw(queries(ref), label="question")
            k = data.draw(st.sampled_from([1, 3, ALL]), label="k")
            q = hash_embed([question])[0]
            pairs = {
                "exact": (full.reader.search(q, k, tokens, exact=True),
                          readable_only.reader.search(q, k, tokens, exact=True)),
                "keyword": (full.reader.keyword_search(question, k, tokens),
                            readable_only.reader.keyword_search(question, k, tokens)),
            }
            for what, (a, b) in pairs.items():
                assert located(full.reader, a) == located(readable_only.reader, b), (what, question)
                assert np.allclose([s for _, s in a], [s for _, s in b], atol=1e-5), (what, question)
    finally:
        full.close()
        readable_only.close()
