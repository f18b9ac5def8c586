"""Context packing: numbered sources in a canonical order, the question last.

Sources are ordered by (document, chunk) rather than by score, so that requests sharing
documents share a token prefix (the generation engine's prefix cache can reuse it), and
the question always comes last. Citation numbers follow that order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from rag.types import Citation, Hit

SYSTEM_PROMPT = (
    "Answer the question in one or two sentences using only the numbered sources below. "
    "Cite the sources you use like [1]. If the sources do not say, answer: I don't know."
)
# Small models follow an instruction next to the question better than one in the system turn.
ANSWER_INSTRUCTION = "Answer in one or two sentences."


def select_sources(hits: Sequence[Hit], count_tokens: Callable[[str], int],
                   budget_tokens: int) -> list[Hit]:
    """The best hits that fit the token budget (at least one, truncated if it must)."""
    chosen: list[Hit] = []
    used = 0
    for hit in hits:
        cost = count_tokens(hit.text) + 8
        if used + cost > budget_tokens and chosen:
            continue
        chosen.append(hit)
        used += cost
    return chosen


def canonical_order(hits: Sequence[Hit]) -> list[Hit]:
    return sorted(hits, key=lambda h: (h.document_key, h.chunk_index))


def build_messages(question: str, sources: Sequence[Hit]) -> list[dict[str, str]]:
    """Chat messages: system, then one user turn with the numbered sources and the question."""
    blocks = []
    for n, hit in enumerate(sources, 1):
        name = hit.title or hit.document_key.rsplit("/", 1)[-1]
        blocks.append(f"[{n}] {name}\n{hit.text.strip()}")
    context = "\n\n".join(blocks) if blocks else "(no sources available to you)"
    user = f"Sources:\n\n{context}\n\nQuestion: {question.strip()}\n{ANSWER_INSTRUCTION}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def citations_for(sources: Sequence[Hit]) -> list[Citation]:
    return [
        Citation(number=n, document_key=h.document_key, source=h.source,
                 chunk_index=h.chunk_index, score=h.score, text=h.text)
        for n, h in enumerate(sources, 1)
    ]


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text.strip()) if s.strip()]


def _key(sentence: str) -> str:
    return " ".join(sentence.lower().split())


def trim_repetition(text: str) -> str:
    """Cut an answer where it starts repeating a sentence it already said.

    Small greedy models fall into loops; a repeated sentence adds nothing for the reader.
    """
    seen: set[str] = set()
    kept: list[str] = []
    for sentence in _sentences(text):
        if _key(sentence) in seen:
            break
        seen.add(_key(sentence))
        kept.append(sentence)
    return " ".join(kept)


def is_repeating(text: str) -> bool:
    """True once a finished sentence of `text` repeats an earlier one (generation can stop)."""
    finished = _sentences(text)
    if finished and not re.search(r"[.!?\n]\s*$", text):
        finished = finished[:-1]  # the last sentence is still being written
    keys = [_key(s) for s in finished]
    return len(keys) != len(set(keys))
