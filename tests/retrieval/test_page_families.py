"""Versioned pages (titles equal but for their numbers) share one per-document cap: the key, the
cap, and the Retriever over a real store."""

from __future__ import annotations

import pytest

from permissions.models import Principal
from rag.types import Hit
from retrieval.diversity import cap_per_document
from retrieval.page_families import page_family
from retrieval.retriever import Retriever
from tests.fuzz_corpus import hash_embed
from tests.retrieval.test_retrieval_properties import Backend


def hit(doc: str, title: str | None, chunk_id: int, score: float = 0.0) -> Hit:
    return Hit(chunk_id=chunk_id, document_key=doc, source=doc, chunk_index=0, text=f"{doc} {chunk_id}",
               score=score, title=title)


def test_titles_equal_but_for_their_numbers_are_one_family():
    releases = [hit(f"release-15-{n}.html", f"E.{19 - n}. Release 15.{n}", n) for n in range(1, 6)]
    assert len({page_family(h) for h in releases}) == 1
    assert page_family(hit("a", "8.3. Character Types", 1)) != page_family(hit("b", "8.4. Binary Data Types", 2))
    # Titles without a number are not versions of one another: two READMEs stay two documents.
    assert page_family(hit("x/README.md", "README", 1)) != page_family(hit("y/README.md", "README", 2))
    assert page_family(hit("u", None, 1)) != page_family(hit("v", None, 2))
    assert page_family(hit("n", "2024", 1)) != page_family(hit("m", "2025", 2))  # only a number: no words


def test_a_family_takes_at_most_the_cap_and_fills_when_nothing_else_is_left():
    releases = [hit(f"release-15-{n}", f"Release 15.{n}", n) for n in range(1, 6)]
    upgrade = hit("pgupgrade", "pg_upgrade", 10)
    ranked = [*releases[:4], upgrade, releases[4]]
    assert [h.document_key for h in cap_per_document(ranked, 3, 2, family=page_family)] == [
        "release-15-1", "release-15-2", "pgupgrade"]
    assert [h.document_key for h in cap_per_document(ranked, 3, 2)] == [  # without families: as before
        "release-15-1", "release-15-2", "release-15-3"]
    # only the family left: its other pages fill the places, best first
    assert [h.chunk_id for h in cap_per_document(releases, 4, 2, family=page_family)] == [1, 2, 3, 4]


@pytest.fixture
def manual():
    backend = Backend("faiss")
    question = "upgrade without dump and reload"
    for n in range(1, 7):  # the boilerplate every minor release repeats, in a page of its own
        backend.write(f"E.{n}. Release 15.{n}", frozenset({"public"}), [f"{question} for those running 15.{n}"])
    backend.write("pg_upgrade", frozenset({"public"}), ["pg_upgrade: upgrade without dump and reload of the data"])
    backend.write("upgrading", frozenset({"public"}), ["upgrading a cluster: dump and reload, or pg_upgrade"])
    backend.write("secret", frozenset({"group:admins"}), [f"{question} secret"])
    yield backend.reader, question
    backend.close()


@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
def test_the_retriever_caps_a_family_of_release_notes(manual, mode):
    reader, question = manual
    bob = Principal("bob")
    hits = Retriever(reader, lambda text: hash_embed([text])[0], max_per_document=2).retrieve(
        question, bob, k=4, candidates=20, rerank=False, mode=mode).hits
    releases = [h for h in hits if h.document_key.startswith("E.")]
    assert len(hits) == 4 and len(releases) == 2
    assert {"pg_upgrade", "upgrading"} <= {h.document_key for h in hits}
    assert all(bob.can_read(h.acl) for h in hits)  # the freed places go to readable pages only
