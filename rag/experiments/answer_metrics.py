"""Answer metrics anyone can check by hand: citation precision, expected-fact containment, refusals.

No model judges here. Each measure is a string comparison a reader can redo:

- **refused**: the answer is empty or starts with "I don't know" (or a close variant), which
  is what the pipeline says when nothing the asker may read answers the question;
- **refusal outcome**: "correct refusal" (nothing readable answers it, and the answer says so),
  "wrong answer" (it should have refused and did not), "false refusal" (answerable, refused),
  or "answered";
- **citation precision**: of the `[n]` markers in the answer, the share pointing at a source
  that contains the answer: a labelled relevant source, or one whose cited text contains the
  expected fact;
- **expected found**: the expected fact occurs in the answer (case and whitespace ignored).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass

from rag.experiments.metrics import matches
from rag.types import Citation

# [3] or [1, 2]: the shapes rag.citations keeps in answers.
_MARKER = re.compile(r"\[(\d{1,3}(?:\s*,\s*\d{1,3})*)\]")
_REFUSAL = re.compile(r"^\W*(i\s+(don'?t|do\s+not)\s+know|i\s+cannot\s+answer|i\s+can'?t\s+answer|"
                      r"none\s+of\s+the\s+(documents|sources))", re.IGNORECASE)


def normalize(text: str) -> str:
    """Case-folded, whitespace collapsed: how facts are compared."""
    return " ".join(text.replace("’", "'").casefold().split())


def is_refusal(text: str | None) -> bool:
    return not (text or "").strip() or _REFUSAL.match(text or "") is not None


def contains_fact(text: str | None, expected: str | None) -> bool | None:
    """Whether `text` contains the expected fact (None when the set gives none)."""
    if not expected:
        return None
    return normalize(expected) in normalize(text or "")


def cited_numbers(text: str | None) -> list[int]:
    """Every citation number in the text, one per mention, in order ([1, 2] gives 1 and 2)."""
    return [int(n) for m in _MARKER.finditer(text or "") for n in m.group(1).split(",")]


def refusal_outcome(should_refuse: bool, refused: bool) -> str:
    if should_refuse:
        return "correct refusal" if refused else "wrong answer"
    return "false refusal" if refused else "answered"


@dataclass(frozen=True)
class AnswerScore:
    refused: bool
    refusal: str  # refusal_outcome
    markers: int  # [n] mentions in the answer
    correct_markers: int  # of those, pointing at a source with the answer
    expected_found: bool | None

    @property
    def citation_precision(self) -> float:
        """NaN for an answer with no markers: precision over nothing is undefined, not perfect."""
        return self.correct_markers / self.markers if self.markers else math.nan

    @property
    def refusal_correct(self) -> bool:
        return self.refusal in ("correct refusal", "answered")


def score_answer(text: str | None, citations: list[Citation], labels: list[str], relevant: Collection[str],
                 expected: str | None, should_refuse: bool) -> AnswerScore:
    """Score one answer.

    Args:
        text: the answer text (None: not generated, counted as a refusal).
        citations: the answer's citations; `[n]` points at the one numbered n.
        labels: each citation's source label (as `rag.experiments.ground_truth.label_of` gives it), same order.
        relevant: the answer sources the asker may read.
        expected: the expected fact, if the set gives one.
        should_refuse: nothing the asker may read answers the question.
    """
    refused = is_refusal(text)
    by_number = {c.number: (c, label) for c, label in zip(citations, labels, strict=True)}
    numbers = [] if refused else cited_numbers(text)
    correct = 0
    for n in numbers:
        cited = by_number.get(n)
        if cited is None:
            continue  # a marker with no source (the pipeline removes these) is simply wrong
        citation, label = cited
        if any(matches(label, r) for r in relevant) or bool(contains_fact(citation.text, expected)):
            correct += 1
    return AnswerScore(refused=refused, refusal=refusal_outcome(should_refuse, refused), markers=len(numbers),
                       correct_markers=correct, expected_found=contains_fact(text, expected))
