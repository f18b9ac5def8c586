"""At most N hits per document in the top k: the cap itself, and the Retriever over a real store.

The Retriever tests use the embedded collection (real SQLite catalog and vector index) with the
hash embedder of the fuzz corpus, so a query sharing a chunk's words ranks it high.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from permissions.models import Principal
from rag.errors import ConfigError
from rag.types import Hit
from retrieval.diversity import PAGE_EVIDENCE, cap_per_document, rank_pages
from retrieval.records import ChunkRecord
from retrieval.retriever import Retriever
from tests.fuzz_corpus import hash_embed
from tests.retrieval.test_retrieval_properties import Backend


def hit(doc: str, i: int, score: float = 0.0) -> Hit:
    return Hit(chunk_id=hash((doc, i)) & 0xFFFF, document_key=doc, source=doc, chunk_index=i,
               text=f"{doc} {i}", score=score)


def names(hits: list[Hit]) -> list[str]:
    return [f"{h.document_key}{h.chunk_index}" for h in hits]


def test_cap_keeps_order_and_fills_from_the_next_documents() -> None:
    hits = [hit("a", 0), hit("a", 1), hit("a", 2), hit("b", 0), hit("a", 3), hit("c", 0), hit("b", 1)]
    assert names(cap_per_document(hits, 4, 2)) == ["a0", "a1", "b0", "c0"]
    assert names(cap_per_document(hits, 4, 1)) == ["a0", "b0", "c0", "a1"]  # too few others: filled in order
    assert names(cap_per_document(hits, 4, None)) == ["a0", "a1", "a2", "b0"]
    assert cap_per_document(hits, 0, 2) == []
    with pytest.raises(ValueError, match="max_per_document"):
        cap_per_document(hits, 4, 0)
    with pytest.raises(ValueError, match="k must be"):
        cap_per_document(hits, -1, 2)


@pytest.fixture
def store():
    backend = Backend("faiss")
    question = "how do I request a gpu node with sbatch gres"
    # One long page that repeats the question's words in every chunk, and two shorter pages.
    backend.write("long", frozenset({"public"}), [f"{question} part {i}" for i in range(6)])
    backend.write("short", frozenset({"public"}), ["ask for a gpu please"])
    backend.write("secret", frozenset({"group:secret"}), [f"{question} secret {i}" for i in range(4)])
    backend.write("faq", frozenset({"group:lab"}), ["the sbatch manual"])
    yield backend.reader, question
    backend.close()


@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_retriever_caps_each_document_and_fills_with_readable_hits_only(store, mode) -> None:
    reader, question = store
    bob = Principal("bob", frozenset({"lab"}))

    def retrieve(cap: int | None) -> list[Hit]:
        retriever = Retriever(reader, lambda text: hash_embed([text])[0], max_per_document=cap)
        return retriever.retrieve(question, bob, k=4, candidates=20, rerank=False, mode=mode).hits

    uncapped, capped = retrieve(None), retrieve(2)
    assert [h.document_key for h in uncapped] == ["long"] * 4
    assert sorted(h.document_key for h in capped) == ["faq", "long", "long", "short"]
    # The freed places go to readable pages: never to "secret", which matches the question best.
    assert all(bob.can_read(h.acl) for h in capped)


class RepeatingLeakyStore:
    """Ignores the ACL filter: forbidden chunks sit between the readable ones in every leg."""

    name = "leaky"
    order = [("a", 0), ("a", 1), ("a", 2), ("f", 0), ("f", 1), ("a", 3), ("b", 0)]
    acl = {"a": frozenset({"public"}), "f": frozenset({"group:secret"}), "b": frozenset({"public"})}

    def refresh(self) -> bool:
        return False

    def search(self, query, k, tokens, exact=False):
        return [(i, 1.0 - i / 10) for i in range(len(self.order))][:k]

    def keyword_search(self, text, k, tokens):
        return self.search(None, k, tokens)

    def chunk_records(self, ids):
        out = {}
        for i in ids:
            doc, index = self.order[i]
            out[i] = ChunkRecord(i, doc, doc, None, index, f"text {doc}{index}", None, self.acl[doc])
        return out


class ReversingReranker:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def rerank(self, query, hits, top_n=None):
        self.seen = [h.chunk_id for h in hits]
        return [Hit(**{**h.__dict__, "score": float(n)}) for n, h in enumerate(hits)][::-1][:top_n]


@pytest.mark.parametrize("rerank", [False, True])
def test_cap_applies_after_the_post_check(rerank) -> None:
    reranker = ReversingReranker()
    retriever = Retriever(RepeatingLeakyStore(), lambda q: hash_embed([q])[0], reranker, max_per_document=1)
    hits = retriever.retrieve("q", Principal("bob"), k=3, candidates=7, rerank=rerank, mode="dense").hits
    # Two readable documents only: the third place is filled from "a" again, never from "f".
    assert {h.document_key for h in hits} == {"a", "b"} and len(hits) == 3
    if rerank:
        assert set(reranker.seen) == {0, 1, 2, 5, 6}  # every readable candidate scored, no forbidden one


def test_invalid_cap_is_a_config_error(store) -> None:
    reader, _ = store
    with pytest.raises(ConfigError, match="max_per_document"):
        Retriever(reader, lambda text: hash_embed([text])[0], max_per_document=0)


def test_the_service_settings_reach_the_retriever(tmp_path):
    """`max_hits_per_document` and `fuse_rerank` are what `Rag.retriever` builds its Retriever with."""
    from rag.pipeline import Rag
    from rag.settings import load_settings

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nalpha beta gamma\n")
    for cap, fuse in ((2, True), (1, False), (0, True)):
        r = Rag(load_settings(home=tmp_path / f"home-{cap}-{fuse}", store="memory",
                              max_hits_per_document=cap, fuse_rerank=fuse))
        try:
            r.ingest([docs], progress=False)
            retriever = r.retriever(rerank=False)
            assert (retriever.max_per_document, retriever.fuse_rerank) == (cap or None, fuse)  # 0: no cap
        finally:
            r.close()


def titled(doc: str, i: int, title: str | None = None) -> Hit:
    return Hit(chunk_id=hash((doc, i)) & 0xFFFF, document_key=doc, source=doc, chunk_index=i,
               text=f"{doc} {i}", score=0.0, title=title)


def test_rank_pages_orders_documents_by_best_chunk_plus_weighted_second() -> None:
    # a0 at rank 1 scores 1/61 = 0.016393; b's best at rank 2 scores 1/62 = 0.016129, and its
    # second at rank 3 adds 0.05 / 63 = 0.000794: b = 0.016923 > a. b2 at rank 4 adds nothing.
    hits = [titled("a", 0), titled("b", 0), titled("b", 1), titled("b", 2), titled("c", 0)]
    assert names(rank_pages([hits], 3, evidence=0.05)) == ["b0", "a0", "c0"]
    # Without the evidence, the best chunks alone decide.
    assert names(rank_pages([hits], 3, evidence=0.0)) == ["a0", "b0", "c0"]
    # 0.02: 0.016129 + 0.000317 = 0.016446 > 0.016393, b first by a hair; 0.01: 0.016288 < a.
    assert names(rank_pages([hits], 3, evidence=0.02)) == ["b0", "a0", "c0"]
    assert names(rank_pages([hits], 3, evidence=0.01)) == ["a0", "b0", "c0"]
    # Only the second-best chunk counts. "long" from rank 6 on: 1/66 + 0.05/67 = 0.015898 passes
    # c0 (1/63 = 0.015873) but not b0 (1/62); its other ten chunks (a sum of 0.0076 more at 0.05)
    # would have put it first.
    long_page = [titled(d, 0) for d in "abcde"] + [titled("long", i) for i in range(12)]
    assert names(rank_pages([long_page], 4, evidence=0.05)) == ["a0", "b0", "long0", "c0"]
    assert rank_pages([hits], 0) == []
    with pytest.raises(ValueError, match="evidence"):
        rank_pages([hits], 3, evidence=-0.1)
    with pytest.raises(ValueError, match="k must be"):
        rank_pages([hits], -1)


def test_rank_pages_fuses_pages_by_their_best_chunk_in_each_order() -> None:
    # Retrieval: x0 y0 y1 z0 w0 x1. Reranker: y1 x1 x0 w0 z0 y0 (its hits carry its scores).
    retrieved = [titled("x", 0), titled("y", 0), titled("y", 1), titled("z", 0), titled("w", 0), titled("x", 1)]
    by_id = {h.chunk_id: h for h in retrieved}
    scores = (("y", 1, 5.0), ("x", 1, 4.0), ("x", 0, 3.0), ("w", 0, 2.0), ("z", 0, 1.0), ("y", 0, 0.5))
    reranked = [replace(by_id[titled(d, i).chunk_id], score=s) for d, i, s in scores]
    # Per page, best chunk in each order: x 1/61 + 1/62 = 0.032522; y 1/62 + 1/61 = 0.032522
    # (a tie: the reranker's order, y first); z 1/64 + 1/65 = 0.031010; w 1/65 + 1/64 = 0.031010
    # (tie: w, the reranker's).
    top = rank_pages([reranked, retrieved], 4)
    assert names(top) == ["y1", "x1", "w0", "z0"]
    # Each page is shown by its best chunk in the first order, with that order's score.
    assert [h.score for h in top] == [5.0, 4.0, 2.0, 1.0]
    # One order alone: the pages of that order, by their best chunk.
    assert names(rank_pages([retrieved], 4)) == ["x0", "y0", "z0", "w0"]
    assert names(rank_pages([reranked], 4)) == ["y1", "x1", "w0", "z0"]
    # A page the first order lacks is not ranked: the other orders only vote.
    assert names(rank_pages([reranked[:2], retrieved], 3)) == ["y1", "x1"]
    with pytest.raises(ValueError, match="at least one order"):
        rank_pages([], 3)


def test_rank_pages_takes_one_page_per_family_and_fills_when_documents_run_out() -> None:
    from retrieval.page_families import page_family

    notes = [titled("r1", 0, "E.2. Release 15.17"), titled("r2", 0, "E.1. Release 15.18"),
             titled("up", 0, "pg_upgrade"), titled("r1", 1, "E.2. Release 15.17")]
    assert names(rank_pages([notes], 2, family=page_family)) == ["r10", "up0"]
    # Three places, two families: the skipped family member, then further chunks, fill the rest.
    assert names(rank_pages([notes], 3, family=page_family)) == ["r10", "up0", "r20"]
    assert names(rank_pages([notes], 4, family=page_family)) == ["r10", "up0", "r20", "r11"]


def test_a_retriever_searches_deeper_when_one_page_holds_every_candidate(store) -> None:
    """Real store: the three candidates are all "long"'s; the deeper search finds the other readable pages."""
    reader, question = store
    bob = Principal("bob", frozenset({"lab"}))
    for mode in ("dense", "keyword", "hybrid"):
        result = Retriever(reader, lambda text: hash_embed([text])[0], max_per_document=1).retrieve(
            question, bob, k=3, candidates=3, rerank=False, mode=mode)
        assert sorted(h.document_key for h in result.hits) == ["faq", "long", "short"], mode
        assert "deepen" in result.timings
        # A cap of 2 over two candidates (both "long"'s) fills two places: the third comes from deeper.
        capped2 = Retriever(reader, lambda text: hash_embed([text])[0], max_per_document=2).retrieve(
            question, bob, k=3, candidates=2, rerank=False, mode=mode)
        keys = [h.document_key for h in capped2.hits]
        assert keys.count("long") == 2 and len(keys) == 3 and set(keys) - {"long"} <= {"faq", "short"}, mode


class DeepLeakyStore(RepeatingLeakyStore):
    """Ignores the ACL filter; records how deep each leg was asked to search."""

    name = "deep-leaky"
    order = [("a", i) for i in range(4)] + [("f", 0), ("f", 1), ("b", 0), ("a", 4), ("c", 0)]
    acl = {"a": frozenset({"public"}), "f": frozenset({"group:secret"}), "b": frozenset({"public"}),
           "c": frozenset({"public"})}

    def __init__(self, size: int | None = None) -> None:
        self.asked: list[int] = []
        self.size = len(self.order) if size is None else size

    def search(self, query, k, tokens, exact=False):
        self.asked.append(k)
        return [(i, 1.0 - i / 10) for i in range(self.size)][:k]


@pytest.mark.parametrize("rerank", [False, True])
def test_the_deeper_search_is_post_checked_and_reranked_without_forbidden_hits(rerank) -> None:
    reranker = ReversingReranker()
    store = DeepLeakyStore()
    retriever = Retriever(store, lambda q: hash_embed([q])[0], reranker, max_per_document=1)
    hits = retriever.retrieve("q", Principal("bob"), k=3, candidates=4, rerank=rerank, mode="dense").hits
    assert store.asked == [4, 12]  # the first fetch, then DEEPEN (3) times deeper
    assert [h.document_key for h in hits][0] == "a" and sorted(h.document_key for h in hits) == ["a", "b", "c"]
    if rerank:
        # The deeper pass scores only new readable pages: not "f" (forbidden), not a4 ("a" is full).
        assert set(reranker.seen) == {6, 8}


def test_no_deeper_search_when_the_legs_have_nothing_more() -> None:
    store = DeepLeakyStore(size=3)  # fewer than asked for: the collection is exhausted
    retriever = Retriever(store, lambda q: hash_embed([q])[0], max_per_document=1)
    hits = retriever.retrieve("q", Principal("bob"), k=3, candidates=4, rerank=False, mode="dense").hits
    assert store.asked == [4] and [h.document_key for h in hits] == ["a", "a", "a"]


def test_default_cap_and_page_evidence_reach_the_retriever(tmp_path) -> None:
    from rag.pipeline import Rag
    from rag.settings import load_settings

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nalpha beta gamma\n")
    r = Rag(load_settings(home=tmp_path / "home", store="memory"))
    try:
        r.ingest([docs], progress=False)
        retriever = r.retriever(rerank=False)
        assert (retriever.max_per_document, retriever.page_evidence) == (1, PAGE_EVIDENCE)
    finally:
        r.close()
    r = Rag(load_settings(home=tmp_path / "home2", store="memory", page_evidence=0.05))
    try:
        r.ingest([docs], progress=False)
        assert r.retriever(rerank=False).page_evidence == 0.05
    finally:
        r.close()
    with pytest.raises(ConfigError, match="page_evidence"):
        Retriever(DeepLeakyStore(), lambda text: hash_embed([text])[0], page_evidence=-1)
