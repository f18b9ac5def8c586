"""The dense feedback leg with the real store and models: it reads only what the asker may read,
it is the first pass's best hits that feed it, and the `dense_feedback` setting turns it off."""

from __future__ import annotations

import pytest

from retrieval.feedback import FEEDBACK_HITS

QUESTION = "Which GPU nodes can I use?"


@pytest.fixture
def embedded_texts(lab_rag, monkeypatch):
    """Every text the Rag's query embedder is given, in order (the question first)."""
    texts: list[str] = []
    real = lab_rag.query_embedder

    class Recording:
        def __call__(self, text):
            texts.append(text)
            return real(text)

        def many(self, batch):
            texts.extend(batch)
            return real.many(batch)

    monkeypatch.setattr(lab_rag, "query_embedder", Recording())
    return texts


@pytest.mark.parametrize("user", ["alice", "bob", "carol", "dave"])
def test_feedback_embeds_only_the_best_readable_first_pass_hits(lab_rag, embedded_texts, user):
    principal = lab_rag.principal(user)
    candidates = lab_rag.settings.candidates
    # The first pass as the feedback leg sees it: both legs fused, post-checked, not yet
    # reranked or capped (k = candidates, so each leg fetches as many as in the real query).
    first_pass = lab_rag.retriever()
    first_pass.dense_feedback, first_pass.reranker, first_pass.max_per_document = False, None, None
    best = first_pass.retrieve(QUESTION, principal, k=candidates, candidates=candidates, mode="hybrid").hits
    del embedded_texts[:]
    result = lab_rag.retriever().retrieve(QUESTION, principal, k=5, candidates=candidates, mode="hybrid")
    assert "feedback" in result.timings
    assert embedded_texts[0] == QUESTION
    passages = embedded_texts[1:]
    readable = {row["text"] for row in lab_rag.collection().dump() if principal.can_read(frozenset(row["acl"]))}
    assert passages and set(passages) <= readable
    assert passages == [h.text for h in best[:FEEDBACK_HITS]]

def test_the_setting_turns_the_feedback_leg_off(lab_rag, rag_factory, embedded_texts):
    off = rag_factory(lab_rag.settings.home, dense_feedback=False)
    result = off.retriever().retrieve(QUESTION, off.principal("carol"), k=5, mode="hybrid")
    assert result.hits and "feedback" not in result.timings
    assert lab_rag.settings.dense_feedback and not off.retriever().dense_feedback
