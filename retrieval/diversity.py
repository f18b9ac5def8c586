"""At most N hits per document in the top k, so one long page cannot fill the whole answer context.

A reference page cut into many similar chunks often takes every one of the top 5 places for a
question that another page answers better; capping each document leaves room for the next
candidates. The cap only reorders hits the caller already holds (post-checked ones), so it can
never bring in a chunk the principal may not read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rag.types import Hit


def cap_per_document(hits: Sequence[Hit], k: int, max_per_document: int | None,
                     family: Callable[[Hit], str] | None = None) -> list[Hit]:
    """The first `k` of `hits` (best first) with at most `max_per_document` from any one document.

    Places a capped document would take go to the next hits of other documents, in order. When
    there are not enough of those, the skipped hits fill the rest, best first, after the others:
    fewer hits would leave the generator less to work with and make none of them more relevant.

    Args:
        hits: best first, already permission-checked.
        k: how many to return (>= 0).
        max_per_document: the cap (>= 1), or None for no cap.
        family: a key of pages that count as one document for the cap too (e.g.
            `retrieval.page_families.page_family`: the release notes of every minor version).

    Raises:
        ValueError: k < 0 or max_per_document < 1.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if max_per_document is None:
        return list(hits[:k])
    if max_per_document < 1:
        raise ValueError(f"max_per_document must be >= 1 or None, got {max_per_document}")
    kept: list[Hit] = []
    skipped: list[Hit] = []
    per_document: dict[str, int] = {}
    per_family: dict[str, int] = {}
    for hit in hits:
        if len(kept) == k:
            break
        taken = per_document.get(hit.document_key, 0)
        group = family(hit) if family is not None else None
        if taken < max_per_document and (group is None or per_family.get(group, 0) < max_per_document):
            per_document[hit.document_key] = taken + 1
            if group is not None:
                per_family[group] = per_family.get(group, 0) + 1
            kept.append(hit)
        else:
            skipped.append(hit)
    # Fillers go after every hit within the cap: another page beats a document's third chunk.
    return kept + skipped[:k - len(kept)]
