"""Context packing: canonical order, numbered citations, budget, repetition trimming."""

from __future__ import annotations

from rag.prompts import build_messages, canonical_order, citations_for, select_sources
from rag.types import Hit


def _hit(key: str, idx: int, text: str, score: float) -> Hit:
    return Hit(chunk_id=idx, document_key=key, source=f"/d/{key}", chunk_index=idx, text=text,
               score=score, title=key)


def test_sources_in_canonical_order_and_numbered():
    hits = [_hit("b.md", 0, "beta", 0.9), _hit("a.md", 2, "alpha two", 0.8), _hit("a.md", 1, "alpha one", 0.1)]
    ordered = canonical_order(hits)
    assert [(h.document_key, h.chunk_index) for h in ordered] == [("a.md", 1), ("a.md", 2), ("b.md", 0)]
    msgs = build_messages("  Why?  ", ordered)
    user = msgs[-1]["content"]
    assert user.index("[1] a.md\nalpha one") < user.index("[2] a.md\nalpha two") < user.index("[3] b.md\nbeta")
    assert "Question: Why?" in user and user.rstrip().endswith("sentences.")
    assert [c.number for c in citations_for(ordered)] == [1, 2, 3]


def test_budget_keeps_best_first_and_at_least_one():
    hits = [_hit("a", 0, "x " * 50, 3.0), _hit("b", 0, "y " * 50, 2.0), _hit("c", 0, "z", 1.0)]
    count = lambda s: len(s.split())  # noqa: E731
    assert [h.document_key for h in select_sources(hits, count, 70)] == ["a", "c"]
    assert [h.document_key for h in select_sources(hits, count, 5)] == ["a"]


def test_no_sources_says_so():
    assert "(no sources available to you)" in build_messages("q", [])[-1]["content"]


def test_is_repeating_waits_for_finished_sentences():
    from rag.prompts import is_repeating

    assert not is_repeating("Use gpu01. Use gpu")
    assert is_repeating("Use gpu01. Use gpu01.")
    assert is_repeating("Use gpu01.\nAsk first.\nUse gpu01.\n")
    assert not is_repeating("One. Two. Three.")


def test_the_user_turn_is_parts_and_a_chunk_part_does_not_depend_on_its_position():
    from rag.prompts import build_prompt

    a, b = _hit("a.md", 1, "alpha one", 0.9), _hit("b.md", 0, "beta", 0.8)
    first, second = build_prompt("Why?", [a, b]), build_prompt("How?", [b, a], [{"role": "user", "content": "hi"}])
    for prompt in (first, second):
        assert "".join(p.text for p in prompt.parts) == prompt.messages[-1]["content"]
        assert [p.kind for p in prompt.parts] == ["head", "label", "chunk", "label", "chunk", "user"]
    chunks = lambda p: {p.parts[i].text for i in (2, 4)}  # noqa: E731
    assert chunks(first) == chunks(second) == {" a.md\nalpha one\n\n", " b.md\nbeta\n\n"}
    assert [p.text for p in second.parts if p.kind == "label"] == ["[1]", "[2]"]
    assert second.parts[2].source == 0 and second.parts[2].text.startswith(" b.md")
    assert second.user_part.startswith("Conversation so far:\nUser: hi") and second.user_part.endswith("sentences.")
