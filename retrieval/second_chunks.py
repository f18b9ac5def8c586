"""A source page's second-best chunk, read by the answer stage beside its best one.

With one hit per page (`max_hits_per_document = 1`) the top k holds k pages, which finds the
right pages more often than two chunks a page (docs/benchmarks.md), but the answer loses the
second chunk that often holds the sentence to quote: the definition is in one chunk, its value
in the next. So the retriever also names each top page's next-best candidate chunk, and the
answer stage reads the two as one source: one citation number, one page.

Only candidates the retriever already post-checked are named, each from the same document as
the hit it joins, so a joined source holds nothing the asker may not read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from rag.types import Hit


def second_chunks(top: Sequence[Hit], ranked: Sequence[Hit]) -> dict[int, Hit]:
    """For each hit of `top`, the next chunk of its document in `ranked`, when that chunk earned it.

    A second chunk joins only if it ranks above the last-placed of the top hits in `ranked`:
    it is then better than a source the asker is shown anyway, as two hits a page would have
    let it in on its own. Weaker chunks would only crowd the answer stage's choice.

    Args:
        top: the hits returned, one per document.
        ranked: the post-checked candidates best first (the reranker's order when it ran).

    Returns:
        {chunk_id of a top hit: its document's best other candidate}.
    """
    place = {h.chunk_id: i for i, h in enumerate(ranked)}
    limit = max((place[h.chunk_id] for h in top if h.chunk_id in place), default=-1)
    # A document's first hit in `top` is its best; a further one (places filled once the
    # documents ran out) is already shown, so it is not read twice.
    wanted: dict[str, int] = {}
    for h in top:
        wanted.setdefault(h.document_key, h.chunk_id)
    shown = {h.chunk_id for h in top}
    found: dict[int, Hit] = {}
    for hit in ranked[:limit]:
        first = wanted.get(hit.document_key)
        if first is not None and hit.chunk_id not in shown and first not in found:
            found[first] = hit
    return found


def _lead(text: str) -> str:
    """A chunk's first block: the section's title context when the chunker put one there."""
    return text.split("\n\n", 1)[0]


def join_texts(first: str, later: str) -> str:
    """Two chunks of one page as one text, `first` before `later` in the document.

    The later chunk's leading block is dropped when it repeats the first's (the same section's
    title context, said once).
    """
    if "\n\n" in later and _lead(later) == _lead(first):
        later = later.split("\n\n", 1)[1]
    return f"{first}\n\n{later}"


def joined(hit: Hit, second: Hit) -> Hit:
    """`hit` whose text is both chunks in document order, naming `second` as its joined chunk.

    The joined hit keeps `hit`'s identity and score (it is cited, ranked and shown as `hit`).
    """
    if second.document_key != hit.document_key:
        raise ValueError(f"a second chunk must come from the same document: {second.document_key!r} "
                         f"joins {hit.document_key!r}")
    first, later = _in_document_order(hit, second)
    return replace(hit, text=join_texts(first.text, later.text), joined_chunk_id=second.chunk_id)


def _in_document_order(hit: Hit, second: Hit) -> list[Hit]:
    return sorted((hit, second), key=lambda h: h.chunk_index)  # stable: `hit` first on a tie


def with_second_chunks(hits: Sequence[Hit], seconds: Mapping[int, Hit],
                       cost: Callable[[Hit], int] | None = None, budget: int | None = None) -> list[Hit]:
    """`hits`, each joined with its second chunk when `seconds` names one.

    With `cost` and `budget` (a prompt's token budget for its sources), second chunks join in
    the hits' order only while the whole still fits: every source keeps its place first, and
    what is left of the budget goes to the best sources' second chunks.
    """
    if (cost is None) != (budget is None):
        raise ValueError("cost and budget go together")
    used = sum(cost(h) for h in hits) if cost is not None else 0
    out = []
    for hit in hits:
        if hit.chunk_id in seconds:
            both = joined(hit, seconds[hit.chunk_id])
            extra = cost(both) - cost(hit) if cost is not None else 0
            if budget is None or used + extra <= budget:
                used += extra
                hit = both
        out.append(hit)
    return out


def reading_parts(hit: Hit, seconds: Mapping[int, Hit]) -> list[Hit]:
    """The chunks a source is read from, in document order: `hit` and its second chunk, or `hit` alone.

    An answer that quotes sentences reads each chunk with its own section heading (a joined
    text carries only the first chunk's in `heading`).
    """
    second = seconds.get(hit.chunk_id)
    return [hit] if second is None else _in_document_order(hit, second)
