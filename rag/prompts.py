"""Context packing: numbered sources in a canonical order, the question last.

Sources are ordered by (document, chunk) rather than by score, so that requests sharing
documents share a token prefix (the generation engine's prefix cache can reuse it), and
the question always comes last. Citation numbers follow that order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rag.relevance import relevance
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


def build_messages(question: str, sources: Sequence[Hit],
                   history: Sequence[dict[str, str]] = ()) -> list[dict[str, str]]:
    """Chat messages: system, then one user turn with the numbered sources and the question."""
    return build_prompt(question, sources, history).messages


@dataclass(frozen=True)
class Prompt:
    """Messages for the generator and the pieces of them that carry their own cache namespace.

    Layout `[system][source 1]…[source k][history][question]`: the head is shared by everyone,
    each source block by whoever may read it, and the history and question are the user's own.
    """

    messages: list[dict[str, str]]
    source_blocks: list[str]
    user_part: str


def build_prompt(question: str, sources: Sequence[Hit],
                 history: Sequence[dict[str, str]] = ()) -> Prompt:
    """The prompt for a question over numbered sources, with earlier turns of a conversation.

    Args:
        history: earlier {"role": "user"|"assistant", "content"} turns, oldest first; they go
            after the sources (so that the sources' KV stays shareable) and before the question.
    """
    blocks = []
    for n, hit in enumerate(sources, 1):
        name = hit.title or hit.document_key.rsplit("/", 1)[-1]
        blocks.append(f"[{n}] {name}\n{hit.text.strip()}")
    context = "\n\n".join(blocks) if blocks else "(no sources available to you)"
    user_part = ""
    if history:
        lines = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content'].strip()}" for m in history]
        user_part = "Conversation so far:\n" + "\n".join(lines) + "\n\n"
    user_part += f"Question: {question.strip()}\n{ANSWER_INSTRUCTION}"
    user = f"Sources:\n\n{context}\n\n{user_part}"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return Prompt(messages, blocks, user_part)


def citations_for(sources: Sequence[Hit], ranked: Sequence[Hit] = (), reranked: bool = False) -> list[Citation]:
    """Numbered citations of `sources` (in their prompt order).

    Args:
        ranked: the retrieved hits best first, which gives each citation its rank (None if absent).
        reranked: the scores are the cross-encoder's, so each citation gets a relevance (rag.relevance).
    """
    rank_of = {h.chunk_id: r for r, h in enumerate(ranked, 1)}
    return [
        Citation(number=n, document_key=h.document_key, source=h.source,
                 chunk_index=h.chunk_index, score=h.score, text=h.text,
                 relevance=relevance(h.score, reranked), rank=rank_of.get(h.chunk_id))
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


class RepeatGuard:
    """Streams answer text but never shows a sentence the answer already said.

    Small greedy models loop. Text is passed on as it comes, except while the sentence being
    written still matches the start of an earlier one: that part is held until it diverges
    (then shown) or completes as a repeat (then dropped, and `repeated` says to stop generating).
    """

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._sentence = ""  # the sentence being written, shown part and held part
        self._held = ""
        self.text = ""  # everything shown
        self.repeated = False

    def feed(self, delta: str) -> str:
        """The part of `delta` (and of what was held) that is safe to show now."""
        out = ""
        for ch in delta:
            if self.repeated:
                break
            prev = self._sentence[-1:] if self._sentence else ""
            if ch == "\n" or (ch.isspace() and prev in (".", "!", "?")):
                out += self._complete()
                out += self._show(ch)
                continue
            self._sentence += ch
            self._held += ch
            if not self._could_repeat():
                out += self._show_held()
        if not self.repeated and self._sentence.rstrip()[-1:] in (".", "!", "?"):
            out += self._complete()  # a sentence that ends the delta counts as finished
        return out

    def flush(self) -> str:
        return "" if self.repeated else self._complete()

    def _could_repeat(self) -> bool:
        key = _key(self._sentence)
        return any(said.startswith(key) for said in self._said)

    def _complete(self) -> str:
        key = _key(self._sentence)
        if key and key in self._said:
            self.repeated = True
            self._sentence = self._held = ""
            return ""
        if key:
            self._said.add(key)
        self._sentence = ""
        return self._show_held()

    def _show_held(self) -> str:
        held, self._held = self._held, ""
        return self._show(held)

    def _show(self, text: str) -> str:
        self.text += text
        return text
