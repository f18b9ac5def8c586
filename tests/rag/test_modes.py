"""Retrieval modes end to end on the sample corpus: dense, keyword, hybrid."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from permissions.models import Principal
from rag.errors import ConfigError
from retrieval.evaluate import evaluate, load_questions

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_keyword_mode_finds_identifiers_only_for_readers(lab_rag):
    # "E-BAM-004" is an error code in the genomics pipeline docs (alice's group only)
    alice = lab_rag.query("How do I fix E-BAM-004?", lab_rag.principal("alice"), k=3,
                          generate=False, rerank=False, mode="keyword")
    assert any("E-BAM-004" in h.text for h in alice.hits)
    for user in ("bob", "carol", "dave"):
        other = lab_rag.query("How do I fix E-BAM-004?", lab_rag.principal(user), k=10,
                              generate=False, rerank=False, mode="keyword")
        assert not any("E-BAM-004" in h.text for h in other.hits)
        assert all(lab_rag.principal(user).can_read(h.acl) for h in other.hits)


def test_unknown_mode_is_a_clear_error(lab_rag):
    with pytest.raises(ConfigError, match="dense, keyword, hybrid"):
        lab_rag.query("anything", lab_rag.principal("dave"), generate=False, mode="fuzzy")


@pytest.mark.slow
def test_hybrid_does_at_least_as_well_as_dense(lab_rag, lab_copy):
    """The reason hybrid is the default: measured on both labelled sets, before the reranker."""
    questions = load_questions(EXAMPLES / "questions.jsonl", EXAMPLES / "keyword-questions.jsonl")
    dense = evaluate(lab_rag, questions, lab_copy, mode="dense", k=5, rerank=False).summary()
    hybrid = evaluate(lab_rag, questions, lab_copy, mode="hybrid", k=5, rerank=False).summary()
    keyword = evaluate(lab_rag, questions, lab_copy, mode="keyword", k=5, rerank=False).summary()
    assert dense["forbidden"] == hybrid["forbidden"] == keyword["forbidden"] == 0
    assert hybrid["hit@5"] >= dense["hit@5"], (dense, hybrid)
    assert hybrid["mrr@5"] >= dense["mrr@5"] - 0.02, (dense, hybrid)


@pytest.mark.slow
def test_query_with_another_embedder_is_refused(rag_factory, tmp_path, lab_copy):
    rag = rag_factory(tmp_path / "home")
    rag.ingest([lab_copy / "public"])
    rag.close()
    # Pretend the collection was built with another model.
    with sqlite3.connect(tmp_path / "home" / "catalog.sqlite") as db:
        db.execute("UPDATE collections SET fingerprint = 'other-model', embedder = 'other/model'")
    rag = rag_factory(tmp_path / "home")
    with pytest.raises(ConfigError, match="other/model"):
        rag.query("Which GPU nodes can I use?", Principal("dave", frozenset()), generate=False, mode="dense")
    # the keyword leg needs no embedder and still works
    hits = rag.query("GPU nodes", Principal("dave", frozenset()), generate=False, rerank=False, mode="keyword").hits
    assert hits
