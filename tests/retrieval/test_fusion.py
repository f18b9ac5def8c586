"""Reciprocal rank fusion: ranks only, one-list ids count, deterministic ties; fusing the reranker's order."""

from __future__ import annotations

import pytest

from rag.types import Hit
from retrieval.fusion import fuse_reranked, reciprocal_rank_fusion


def test_scores_are_sums_of_reciprocal_ranks():
    dense = [(10, 0.9), (20, 0.8), (30, 0.1)]
    keyword = [(20, 12.0), (40, 3.0)]
    fused = dict(reciprocal_rank_fusion([dense, keyword], k=60))
    assert fused[20] == pytest.approx(1 / 62 + 1 / 61)
    assert fused[10] == pytest.approx(1 / 61)
    assert fused[30] == pytest.approx(1 / 63)
    assert fused[40] == pytest.approx(1 / 62)  # found by one list only: still counts


def test_an_id_in_both_lists_beats_one_ranked_first_in_only_one():
    dense = [(1, 0.9), (2, 0.5)]
    keyword = [(3, 9.0), (2, 8.0)]
    assert [i for i, _ in reciprocal_rank_fusion([dense, keyword])] == [2, 1, 3]


def test_input_scores_are_ignored_only_order_matters():
    a = reciprocal_rank_fusion([[(1, 100.0), (2, 99.0)], [(2, 0.001), (3, 0.0)]])
    b = reciprocal_rank_fusion([[(1, 0.2), (2, 0.1)], [(2, -5.0), (3, -50.0)]])
    assert a == b


def test_ties_go_to_the_smaller_id_whatever_the_list_order():
    # 7 and 3 each get a rank-1 and a rank-2 vote: an exact tie.
    one = [(7, 1.0), (3, 0.5)]
    two = [(3, 1.0), (7, 0.5)]
    assert [i for i, _ in reciprocal_rank_fusion([one, two])] == [3, 7]
    assert reciprocal_rank_fusion([one, two]) == reciprocal_rank_fusion([two, one])


def test_equal_rank_sets_tie_exactly_with_three_lists_in_any_order():
    # 1, 5 and 9 each get ranks 1, 2 and 7, summed in a different order: a plain float sum
    # gives 1/61 + 1/62 + 1/67 != 1/62 + 1/67 + 1/61 in the last bit, and the tie-break breaks.
    def ranking(first: int, second: int, seventh: int, filler: int) -> list[tuple[int, float]]:
        return [(first, 0.0), (second, 0.0)] + [(filler + j, 0.0) for j in range(4)] + [(seventh, 0.0)]

    lists = [ranking(5, 9, 1, 100), ranking(9, 1, 5, 200), ranking(1, 5, 9, 300)]
    fused = reciprocal_rank_fusion(lists)
    assert [i for i, _ in fused[:3]] == [1, 5, 9]
    assert fused[0][1] == fused[1][1] == fused[2][1]
    assert reciprocal_rank_fusion(lists[::-1]) == fused


def test_ties_by_first_follow_the_first_ranking_not_the_ids():
    # Two legs that swap two items tie them exactly; the first leg's order decides, so chunks
    # numbered differently (a re-ingested collection against a fresh one) come out alike.
    for a, b in [(10, 7), (4, 6)]:
        fused = reciprocal_rank_fusion([[(a, 0.9), (b, 0.8)], [(b, 1.0), (a, 0.5)]], ties_by_first=True)
        assert [i for i, _ in fused] == [a, b] and fused[0][1] == fused[1][1]
    # An id the first ranking lacks goes after those it has, then by id.
    fused = reciprocal_rank_fusion([[(5, 1.0)], [(3, 1.0)], [(9, 1.0)]], ties_by_first=True)
    assert [i for i, _ in fused] == [5, 3, 9]


def test_limit_and_k():
    ranking = [(i, 0.0) for i in range(10)]
    assert [i for i, _ in reciprocal_rank_fusion([ranking], limit=3)] == [0, 1, 2]
    assert reciprocal_rank_fusion([ranking], limit=0) == []
    assert reciprocal_rank_fusion([ranking], k=0)[0] == (0, 1.0)
    # A larger k flattens: rank 1 vs rank 2 matters less.
    small = dict(reciprocal_rank_fusion([ranking], k=1))
    large = dict(reciprocal_rank_fusion([ranking], k=1000))
    assert small[0] / small[1] > large[0] / large[1]


def test_a_repeated_id_within_one_list_counts_once_at_its_best_rank():
    fused = dict(reciprocal_rank_fusion([[(1, 0.0), (2, 0.0), (1, 0.0)]]))
    assert fused[1] == pytest.approx(1 / 61)
    assert fused[2] == pytest.approx(1 / 62)


def test_empty_inputs():
    assert reciprocal_rank_fusion([]) == []
    assert reciprocal_rank_fusion([[], []]) == []
    assert reciprocal_rank_fusion([[], [(4, 1.0)]]) == [(4, pytest.approx(1 / 61))]


@pytest.mark.parametrize("kwargs", [{"k": -1}, {"limit": -1}])
def test_invalid_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        reciprocal_rank_fusion([[(1, 0.0)]], **kwargs)


def _hit(chunk_id: int, score: float) -> Hit:
    return Hit(chunk_id=chunk_id, document_key=f"d{chunk_id}", source="s", chunk_index=0, text=f"t{chunk_id}",
               score=score)


def test_fuse_reranked_keeps_the_retrieval_vote_and_the_reranker_scores():
    retrieved = [_hit(i, 1.0 / (i + 1)) for i in range(5)]  # retrieval order 0 1 2 3 4
    # The reranker puts 0 last (a near-duplicate fooled it); both orders agree 1 beats 2, 3 and 4.
    scores = {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0, 0: 1.0}
    reranked = sorted((_hit(i, scores[i]) for i in range(5)), key=lambda h: -h.score)
    fused = fuse_reranked(retrieved, reranked)
    assert [h.chunk_id for h in fused] == [1, 2, 0, 3, 4]  # 0: first and last = the middle, not the bottom
    assert {h.chunk_id: h.score for h in fused} == scores  # the score shown is still the reranker's


def test_fuse_reranked_ties_go_to_the_reranker():
    retrieved = [_hit(1, 0.9), _hit(2, 0.8)]
    reranked = [_hit(2, 5.0), _hit(1, 4.0)]  # exactly opposite: equal RRF sums
    assert [h.chunk_id for h in fuse_reranked(retrieved, reranked)] == [2, 1]
