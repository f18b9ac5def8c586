"""End to end: answers read each source page's second chunk, and never another page's or an unreadable one.

Real models, a real store: pages of several chunks each, under different ACLs, every chunk
carrying its page's code word. An answer's citations (what it was built from) may hold two
chunks of one page, never a chunk of another page and never a word the asker may not read.
"""

from __future__ import annotations

import json

import pytest

from permissions.models import Principal
from tests.rag.test_no_leaks import PromptRecorder

TOPICS = {
    "freezer": ("group:genomics", "The minus eighty freezer alarm rings when the temperature rises above minus "
                "sixty five degrees. Call the facility manager on the alarm line."),
    "microscope": ("group:imaging", "The cryo microscope is booked on the facility wiki one week ahead. Sessions "
                   "last twenty four hours and start at nine in the morning."),
    "cluster": ("public", "GPU jobs go to the gpu partition with the gres option. A job may use at most four "
                "GPUs outside a reservation."),
    "budget": ("group:genomics", "Sequencing reagents are ordered on the core's recharge account. The cost is "
               "recovered from each project at the end of the quarter."),
}


def _write_corpus(root) -> dict[str, str]:
    """Pages of four sections, a chunk each at 80 tokens, each with a code word; returns {code word: ACL token}."""
    root.mkdir()
    codes = {}
    for topic, (acl, text) in TOPICS.items():
        folder = root / topic
        folder.mkdir()
        (folder / ".rag-acl.toml").write_text(f"allow = {json.dumps([acl])}\n")
        sections = []
        for part in range(4):
            code = f"code{topic}{part}x"
            codes[code] = acl
            sections.append(f"## The {topic} guide, part {part}\n\n{text} The code word of this part is {code}.")
        (folder / f"{topic}.md").write_text("\n\n".join(sections) + "\n")
    return codes


@pytest.mark.slow
@pytest.mark.parametrize("answer_mode", ["extract", "generate"])
def test_answers_read_second_chunks_of_readable_pages_only(tmp_path, rag_factory, answer_mode) -> None:
    codes = _write_corpus(tmp_path / "corpus")
    rag = rag_factory(tmp_path / "home", chunk_max_tokens=80, chunk_overlap_tokens=0, answer_mode=answer_mode,
                      max_new_tokens=16)
    try:
        assert rag.ingest([tmp_path / "corpus"]).ok
        assert rag.settings.max_hits_per_document == 1  # the default under test
        recorder = None
        if answer_mode == "generate":
            recorder = PromptRecorder(rag.generator)
            rag.__dict__["generator"] = recorder
        questions = ["When does the freezer alarm ring?", "How do I book the cryo microscope?",
                     "How many GPUs may a job use?", "Which account pays for sequencing reagents?"]
        users = [Principal("gina", frozenset({"genomics"})), Principal("ian", frozenset({"imaging"})),
                 Principal("pat", frozenset())]
        joined_seen = 0
        for user in users:
            for question in questions[: 4 if answer_mode == "extract" else 1]:
                answer = rag.query(question, user, k=3)
                readable = {c for c, acl in codes.items() if user.can_read(frozenset({acl}))}
                hits = {(h.document_key, h.chunk_index): h for h in answer.hits}
                pages = sum(user.can_read(frozenset({acl})) for acl, _ in TOPICS.values())
                # One hit a page while there are pages (then further chunks fill the places).
                assert len({h.document_key for h in answer.hits}) == min(3, pages)
                for citation in answer.citations:
                    words = {c for c in codes if c in citation.text}
                    page = citation.document_key.rsplit("/", 1)[-1].removesuffix(".md")
                    # Its own page's code words only (one per chunk read), all readable.
                    assert words and words <= readable and all(w.startswith(f"code{page}") for w in words)
                    hit_text = hits[(citation.document_key, citation.chunk_index)].text
                    if citation.text != hit_text:
                        joined_seen += 1
                        assert hit_text.split("\n\n", 1)[-1] in citation.text and len(words) >= 2
                if recorder is not None and answer.citations:
                    prompt = recorder.requests.pop().messages[-1]["content"]
                    assert all(c.text.split("\n\n", 1)[-1] in prompt for c in answer.citations)
                shown = json.dumps([answer.text, [c.text for c in answer.citations], [h.text for h in answer.hits]])
                assert not {c for c in codes if c in shown} - readable, (user.user, question)
        assert joined_seen, "no source was read with its second chunk"
    finally:
        rag.close()
