"""The dense feedback leg: its vector (hand-computed), and that only post-checked hits feed it.

The leak case uses the deliberately broken store of the post-check tests (a fake is right here:
no real store can be made to return a forbidden id); tests/rag/test_query_feedback.py runs the
leg with the real store and models.
"""

from __future__ import annotations

import numpy as np
import pytest

from permissions.models import Principal
from retrieval.feedback import feedback_query
from retrieval.retriever import Retriever
from tests.retrieval.test_retriever_postcheck import LeakyStore


def test_feedback_query_moves_the_query_toward_the_passages_mean():
    query = np.array([1.0, 0.0], dtype=np.float32)
    passages = np.array([[0.0, 1.0], [0.6, 0.8]], dtype=np.float32)  # mean (0.3, 0.9)
    got = feedback_query(query, passages, weight=0.5)  # (1.15, 0.45) / 1.2349...
    np.testing.assert_allclose(got, np.array([1.15, 0.45]) / np.hypot(1.15, 0.45), rtol=1e-6)
    assert got.dtype == np.float32


def test_a_query_opposite_the_passages_stays_the_query():
    query = np.array([0.0, 1.0], dtype=np.float32)
    assert np.array_equal(feedback_query(query, -query[None, :], weight=1.0), query)


@pytest.mark.parametrize("passages, weight", [(np.zeros((0, 2)), 0.5), (np.ones((2, 3)), 0.5),
                                              (np.ones((1, 2)), 0.0)])
def test_feedback_query_refuses_no_passages_wrong_dims_or_no_weight(passages, weight):
    with pytest.raises(ValueError):
        feedback_query(np.array([1.0, 0.0], dtype=np.float32), passages, weight)


class RecordingLeakyStore(LeakyStore):
    """The broken store, also recording each dense search's query vector."""

    def __init__(self) -> None:
        self.dense_queries: list[np.ndarray] = []

    def search(self, query, k, tokens, exact=False):
        self.dense_queries.append(np.asarray(query))
        return super().search(query, k, tokens, exact)

    def chunk_records(self, ids):
        self.record_reads = [*getattr(self, "record_reads", []), list(ids)]
        return super().chunk_records(ids)


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x)).astype(np.float32)


@pytest.mark.parametrize("rerank", [True, False])
def test_only_readable_hits_feed_back_even_when_the_store_leaks(rerank):
    store = RecordingLeakyStore()
    embedded: list[str] = []

    def embed_passages(texts):
        embedded.extend(texts)
        return np.stack([unit(np.array([1.0, float(len(t)), 0.0, 1.0])) for t in texts])

    retriever = Retriever(store, lambda q: unit(np.ones(4)), None, embed_passages=embed_passages)
    bob = Principal("bob", frozenset({"lab"}))  # reads chunk 1 (public) and 4 (group:lab) only
    result = retriever.retrieve("anything", bob, k=5, candidates=10, rerank=rerank, mode="hybrid")
    # The forbidden chunks (2: group:secret, 3: user:alice, 5: nobody) came from both legs, but
    # neither their text nor their vector fed the second search, and none came back.
    assert sorted(embedded) == ["text of chunk 1", "text of chunk 4"]
    assert len(store.dense_queries) == 2 and "feedback" in result.timings
    assert not np.allclose(store.dense_queries[0], store.dense_queries[1])  # it moved
    assert {h.chunk_id for h in result.hits} == {1, 4}
    # The second fusion reuses the first pass's post-checked hits: the store is read for new ids only.
    first, *later = store.record_reads
    assert all(not set(ids) & {1, 4} for ids in later)


@pytest.mark.parametrize("mode", ["dense", "keyword"])
def test_single_leg_modes_search_once_and_embed_no_passages(mode):
    store = RecordingLeakyStore()
    embedded: list[str] = []
    retriever = Retriever(store, lambda q: unit(np.ones(4)), None,
                          embed_passages=lambda texts: embedded.extend(texts) or np.ones((len(texts), 4)))
    result = retriever.retrieve("anything", Principal("bob", frozenset({"lab"})), k=5, candidates=10, mode=mode)
    assert embedded == [] and len(store.dense_queries) == (mode == "dense") and "feedback" not in result.timings

