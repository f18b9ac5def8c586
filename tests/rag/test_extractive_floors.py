"""When an extracted answer is given and when "I don't know", with the real models on the sample corpus.

The rule (rag/extractive.py): quote the best sentences if one reaches the sentence floor, else
the best sentences of the best source if that whole source reaches the source floor, else refuse.
Every question of examples/questions.jsonl that must be refused (its asker may read no answer
source) still gets exactly the pipeline's "I don't know", which says nothing of what exists.
"""

from __future__ import annotations

import json

import pytest

from permissions.models import Principal
from rag.experiments.answer_metrics import cited_numbers
from rag.pipeline import NO_ANSWER
from tests.rag.conftest import LAB_DOCS

QUESTIONS = [json.loads(line) for line in (LAB_DOCS.parent / "questions.jsonl").read_text().splitlines() if line]
MUST_REFUSE = [q for q in QUESTIONS if not q["relevant"]]


def _principal(q: dict) -> Principal:
    return Principal(q["user"], frozenset(q.get("groups", [])))


def test_a_procedure_answered_by_its_source_as_a_whole_is_quoted_not_refused(lab_rag):
    # No single sentence of the data-pipeline page scores above the sentence floor for this
    # question (the best, naming the endpoint, scores about -6.9); the page as a whole does (0.2).
    answer = lab_rag.query("How do I share processed maps with an outside collaborator?",
                           Principal("bob", frozenset({"imaging"})), k=5)
    assert answer.text != NO_ANSWER and "niqb-imaging-dtn" in answer.text
    cited = {c.number: c for c in answer.citations}
    assert {cited[n].source.rsplit("/", 1)[-1] for n in cited_numbers(answer.text)} == {"data-pipeline.html"}


@pytest.mark.parametrize("q", MUST_REFUSE, ids=[f"{q['user']}: {q['question'][:40]}" for q in MUST_REFUSE])
def test_a_question_whose_answer_the_asker_may_not_read_is_still_refused(lab_rag, q):
    principal = _principal(q)
    answer = lab_rag.query(q["question"], principal, k=5)
    assert answer.text == NO_ANSWER
    assert all(principal.can_read(h.acl) for h in answer.hits)


@pytest.mark.xfail(strict=True, reason=(
    "known limit of the packaged cross-encoder, not of the floors: it does not read '/home/USER' as the home "
    "directory, so the answering sentence '/home/USER Quota: 50 GB ...' scores -7.2 and its source -8.2 for this "
    "wording, below what questions that must be refused reach (-3.4 and -3.9); worded 'Your home directory quota "
    "is 50 GB' the same fact scores +2.7. Passing means a better scorer or rule answers it: drop this mark."))
def test_daves_home_directory_question_is_answered(lab_rag):
    answer = lab_rag.query("How much space do I get in my home directory?", Principal("dave", frozenset()), k=5)
    assert "50 GB" in answer.text
