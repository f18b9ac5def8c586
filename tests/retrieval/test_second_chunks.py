"""A source page's second-best chunk: which one, how it joins, and that it never brings in unreadable text."""

from __future__ import annotations

import pytest

from permissions.models import Principal
from rag.types import Hit
from retrieval.retriever import Retriever
from retrieval.second_chunks import joined, second_chunks, with_second_chunks
from tests.fuzz_corpus import hash_embed
from tests.retrieval.test_diversity import RepeatingLeakyStore, ReversingReranker


def chunk(doc: str, i: int, text: str | None = None, score: float = 0.0) -> Hit:
    return Hit(chunk_id=hash((doc, i)) & 0xFFFF, document_key=doc, source=doc, chunk_index=i,
               text=text or f"{doc} {i}", score=score)


def test_each_top_hit_gets_its_documents_next_candidate() -> None:
    ranked = [chunk("a", 3), chunk("b", 0), chunk("a", 1), chunk("a", 0), chunk("c", 2)]
    seconds = second_chunks([chunk("a", 3), chunk("b", 0), chunk("c", 2)], ranked)
    # a's next candidate is a1 (not a0, ranked after it); b and c have no other candidate.
    assert {k: (h.document_key, h.chunk_index) for k, h in seconds.items()} == {chunk("a", 3).chunk_id: ("a", 1)}
    # Shown a3 and b0 only, a1 ranks below every source shown: it would crowd, not help.
    assert second_chunks([chunk("a", 3), chunk("b", 0)], ranked) == {}
    assert second_chunks([chunk("b", 0), chunk("c", 2)], ranked) == {}
    assert second_chunks([], ranked) == {}
    # With the documents run out, a's a1 fills a place too: it is shown, so it is not read twice.
    filled = [chunk("a", 3), chunk("a", 1), chunk("b", 0)]
    assert second_chunks([chunk("a", 3), chunk("b", 0), chunk("a", 1)], filled) == {}


def test_joined_reads_both_chunks_in_document_order_with_the_heading_once() -> None:
    best = chunk("a", 4, "Guide › Freezers\n\nThe alarm sounds at -65 C.", score=3.5)
    earlier = chunk("a", 3, "Guide › Freezers\n\nCall the facility when it sounds.")
    both = joined(best, earlier)
    assert both.text == "Guide › Freezers\n\nCall the facility when it sounds.\n\nThe alarm sounds at -65 C."
    # The joined source is still the best chunk: its identity, place and score.
    assert (both.chunk_id, both.chunk_index, both.score) == (best.chunk_id, 4, 3.5)
    # Another section's heading stays: it says what the later chunk is about.
    later = chunk("a", 9, "Guide › Booking\n\nBook on the wiki.")
    assert joined(best, later).text == f"{best.text}\n\nGuide › Booking\n\nBook on the wiki."
    with pytest.raises(ValueError, match="same document"):
        joined(best, chunk("b", 0))
    assert with_second_chunks([best, later], {best.chunk_id: earlier}) == [both, later]


@pytest.mark.parametrize("rerank", [False, True])
def test_the_retriever_names_second_chunks_only_from_post_checked_candidates(rerank) -> None:
    """A store that ignores the ACL puts forbidden "f" chunks between "a"'s: none becomes a second chunk."""
    retriever = Retriever(RepeatingLeakyStore(), lambda q: hash_embed([q])[0], ReversingReranker(),
                          max_per_document=1)
    result = retriever.retrieve("q", Principal("bob"), k=2, candidates=7, rerank=rerank, mode="dense")
    assert sorted(h.document_key for h in result.hits) == ["a", "b"]
    top = {h.chunk_id: h for h in result.hits}
    assert set(result.seconds) <= set(top)
    for first, second in result.seconds.items():
        assert second.document_key == top[first].document_key and second.chunk_id != first
        assert "f" not in second.text and Principal("bob").can_read(second.acl)
    # "a" has four readable candidates. In retrieval's order a0 a1 a2 a3 b0, a1 ranks above b0,
    # the weakest source shown, and joins a0; the reranker reverses them (b0 a3 a2 a1 a0), so a2
    # ranks below every source shown and a3 is read alone.
    a = next(h for h in result.hits if h.document_key == "a")
    if rerank:
        assert a.chunk_index == 3 and result.seconds == {}
    else:
        assert (a.chunk_index, result.seconds[a.chunk_id].chunk_index) == (0, 1)


def test_no_second_chunks_with_two_hits_a_page() -> None:
    retriever = Retriever(RepeatingLeakyStore(), lambda q: hash_embed([q])[0], max_per_document=2)
    assert retriever.retrieve("q", Principal("bob"), k=3, candidates=7, rerank=False, mode="dense").seconds == {}


def test_second_chunks_join_only_within_the_prompt_budget() -> None:
    a, b = chunk("a", 0, "a " * 10), chunk("b", 0, "b " * 10)
    a2, b2 = chunk("a", 1, "x " * 30), chunk("b", 1, "y " * 30)
    seconds = {a.chunk_id: a2, b.chunk_id: b2}

    def cost(h: Hit) -> int:
        return len(h.text.split())

    # The sources cost 20 words; each second chunk 30 more: 50 fits one (the better source's), 80 both.
    assert [len(h.text.split()) for h in with_second_chunks([a, b], seconds, cost, 50)] == [40, 10]
    assert [len(h.text.split()) for h in with_second_chunks([a, b], seconds, cost, 80)] == [40, 40]
    assert with_second_chunks([a, b], seconds, cost, 20) == [a, b]  # the sources alone: none joins
    # Without a budget (the extractive answer scores sentences, not a prompt), every one joins.
    assert [len(h.text.split()) for h in with_second_chunks([a, b], seconds)] == [40, 40]
    with pytest.raises(ValueError, match="together"):
        with_second_chunks([a, b], seconds, cost)
