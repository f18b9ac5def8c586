"""The second check: hits are checked against their stored ACL after the search, before reranking.

The stores filter inside the search (tested in the contract suites); this checks the defence
behind it, with a deliberately broken store that ignores the filter. A fake is right here: no
real store can be made to return a forbidden id.
"""

from __future__ import annotations

import numpy as np
import pytest

from permissions.models import Principal
from retrieval.records import ChunkRecord
from retrieval.retriever import Retriever

ACLS = {1: frozenset({"public"}), 2: frozenset({"group:secret"}), 3: frozenset({"user:alice"}),
        4: frozenset({"group:lab"}), 5: frozenset()}


class LeakyStore:
    """Returns every chunk from both legs, whatever the principal's tokens say."""

    name = "leaky"

    def refresh(self) -> bool:
        return False

    def search(self, query, k, tokens, exact=False):
        return [(i, 1.0 - i / 10) for i in ACLS][:k]

    def keyword_search(self, text, k, tokens):
        return [(i, float(10 - i)) for i in reversed(ACLS)][:k]

    def chunk_records(self, ids):
        return {i: ChunkRecord(i, f"/doc{i}", f"/doc{i}", None, 0, f"text of chunk {i}", None, ACLS[i])
                for i in ids if i in ACLS}


class RecordingReranker:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def rerank(self, query, hits, top_n=None):
        self.seen += [h.chunk_id for h in hits]
        return list(hits)[:top_n]


@pytest.mark.parametrize("mode", ["dense", "keyword", "hybrid"])
@pytest.mark.parametrize("rerank", [True, False])
def test_forbidden_ids_from_a_broken_store_never_reach_the_reranker_or_the_result(mode, rerank):
    reranker = RecordingReranker()
    retriever = Retriever(LeakyStore(), lambda q: np.ones(4, dtype=np.float32), reranker)
    principal = Principal("bob", frozenset({"lab"}))
    result = retriever.retrieve("anything", principal, k=5, candidates=10, rerank=rerank, mode=mode)
    assert {h.chunk_id for h in result.hits} == {1, 4}  # public and group:lab; not 2, 3 or 5 (nobody)
    assert set(reranker.seen) <= {1, 4}
    if rerank:
        assert set(reranker.seen) == {1, 4}
