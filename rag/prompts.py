"""Context packing: numbered sources, then the conversation and the question.

The user turn is cut into parts made for KV reuse (`build_prompt`):

    head   "Sources:\n\n"                      shared by everyone
    label  "[1]"                                the citation number, a part of its own
    chunk  " {title}\n{text}\n\n"              depends only on the chunk, never on its position
    ...    one label and one chunk per source
    user   "Conversation so far: ...Question: ..."  the user's own, always last

Concatenated, the parts are the text a person or a remote OpenAI server sees. The local engine
tokenizes each part on its own and aligns chunks to KV blocks (`rag.prompt_layout`), so that a
chunk's token ids, and its cached KV, are the same wherever it lands. The order of the sources is
chosen by `rag.source_order` (the cached prefix first); citation numbers follow it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from rag.relevance import relevance
from rag.types import Citation, Hit

SYSTEM_PROMPT = (
    "Answer the question in one or two sentences using only the numbered sources below. "
    "Cite the sources you use like [1]. If the sources do not say, answer: I don't know."
)
# Small models follow an instruction next to the question better than one in the system turn.
ANSWER_INSTRUCTION = "Answer in one or two sentences."


def source_tokens(hit: Hit, count_tokens: Callable[[str], int]) -> int:
    """What a source costs of the prompt's budget: its text and its label's few tokens."""
    return count_tokens(hit.text) + 8


def select_sources(hits: Sequence[Hit], count_tokens: Callable[[str], int],
                   budget_tokens: int) -> list[Hit]:
    """The best hits that fit the token budget (at least one, truncated if it must)."""
    chosen: list[Hit] = []
    used = 0
    for hit in hits:
        cost = source_tokens(hit, count_tokens)
        if used + cost > budget_tokens and chosen:
            continue
        chosen.append(hit)
        used += cost
    return chosen


def canonical_order(hits: Sequence[Hit]) -> list[Hit]:
    """Hits sorted by (document, chunk): the order of retrieval-only answers."""
    return sorted(hits, key=lambda h: (h.document_key, h.chunk_index))


def build_messages(question: str, sources: Sequence[Hit],
                   history: Sequence[dict[str, str]] = ()) -> list[dict[str, str]]:
    """Chat messages: system, then one user turn with the numbered sources and the question."""
    return build_prompt(question, sources, history).messages


PartKind = Literal["head", "label", "chunk", "user"]
NO_SOURCES = "(no sources available to you)"


@dataclass(frozen=True)
class PromptPart:
    """One part of the user turn; the parts, in order, concatenate to its content.

    Attributes:
        kind: "head" (shared), "label" (a citation number), "chunk" (a source's title and
            text), "user" (history and question).
        text: the part's exact text.
        source: for a label or chunk, the index of its source in the prompt's order.
    """

    kind: PartKind
    text: str
    source: int | None = None


@dataclass(frozen=True)
class Prompt:
    """Messages for the generator and the parts of the user turn, each with its own cache namespace.

    Layout `[system][head][label 1][chunk 1]…[label k][chunk k][history + question]`: the system
    turn and the head are shared by everyone, each label and chunk by whoever may read the source,
    and the history and question are the user's own.
    """

    messages: list[dict[str, str]]
    parts: list[PromptPart]

    @property
    def user_part(self) -> str:
        """The history and question (the last part)."""
        return self.parts[-1].text


def source_label(number: int) -> str:
    """The citation label of the source shown `number`-th: its own part, so the chunk after it never changes."""
    return f"[{number}]"


def source_text(hit: Hit) -> str:
    """A source's chunk part: its title and text only, the same wherever the source is placed.

    It starts with a space (the label before it has none) and ends with the blank line that
    separates it from the next part.
    """
    name = hit.title or hit.document_key.rsplit("/", 1)[-1]
    return f" {name}\n{hit.text.strip()}\n\n"


def build_prompt(question: str, sources: Sequence[Hit],
                 history: Sequence[dict[str, str]] = ()) -> Prompt:
    """The prompt for a question over numbered sources, with earlier turns of a conversation.

    Args:
        sources: in the order shown; source i is cited as [i + 1].
        history: earlier {"role": "user"|"assistant", "content"} turns, oldest first; they go
            after the sources (so that the sources' KV stays shareable) and before the question.
    """
    parts = [PromptPart("head", "Sources:\n\n" if sources else f"Sources:\n\n{NO_SOURCES}\n\n")]
    for i, hit in enumerate(sources):
        parts.append(PromptPart("label", source_label(i + 1), i))
        parts.append(PromptPart("chunk", source_text(hit), i))
    user_part = ""
    if history:
        lines = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content'].strip()}" for m in history]
        user_part = "Conversation so far:\n" + "\n".join(lines) + "\n\n"
    user_part += f"Question: {question.strip()}\n{ANSWER_INSTRUCTION}"
    parts.append(PromptPart("user", user_part))
    user = "".join(p.text for p in parts)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return Prompt(messages, parts)


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
                 relevance=relevance(h.score, reranked), rank=rank_of.get(h.chunk_id),
                 joined_chunk_id=h.joined_chunk_id)
        for n, h in enumerate(sources, 1)
    ]


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text.strip()) if s.strip()]


def _key(sentence: str) -> str:
    return " ".join(sentence.lower().split())


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
