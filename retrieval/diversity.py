"""The top k made of different things: at most N hits per document, and no near-duplicate pages.

A reference page cut into many similar chunks often takes every one of the top 5 places for a
question that another page answers better; capping each document leaves room for the next
candidates. Near-duplicates across documents do the same from the other side: eighteen release
notes saying "a dump/restore is not required" fill the top 5 of an upgrade question while the
upgrade guide waits at rank 8, and the generator learns nothing from the second copy. The two
rules only reorder hits the caller already holds (post-checked ones), so they can never bring in
a chunk the principal may not read.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rag.types import Hit

# Jaccard similarity of word trigrams at or above which a hit repeats a better one. Measured on
# the PostgreSQL manual: the release notes' "Migration to Version 15.x" chunks pair at 0.74,
# unrelated hits of one question at <= 0.03 (docs/benchmarks.md).
NEAR_DUPLICATE_SIMILARITY = 0.6
_WORD = re.compile(r"\w+")


def diversify(hits: Sequence[Hit], k: int, max_per_document: int | None,
              near_duplicate: float | None = None) -> list[Hit]:
    """The first `k` of `hits` (best first), with at most `max_per_document` from any one
    document and none that nearly repeats a better kept hit of another document.

    Places a skipped hit would take go to the next hits, in order. When there are not enough of
    those, the skipped hits fill the rest, best first, after the others: fewer hits would leave
    the generator less to work with and make none of them more relevant.

    Args:
        hits: best first, already permission-checked.
        k: how many to return (>= 0).
        max_per_document: the cap (>= 1), or None for no cap.
        near_duplicate: the word-trigram Jaccard similarity (0 < s <= 1) from which a hit counts
            as a repeat of a kept one, or None to keep repeats.

    Raises:
        ValueError: k < 0, max_per_document < 1 or near_duplicate outside (0, 1].
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if max_per_document is not None and max_per_document < 1:
        raise ValueError(f"max_per_document must be >= 1 or None, got {max_per_document}")
    if near_duplicate is not None and not 0.0 < near_duplicate <= 1.0:
        raise ValueError(f"near_duplicate must be in (0, 1] or None, got {near_duplicate}")
    if max_per_document is None and near_duplicate is None:
        return list(hits[:k])
    kept: list[Hit] = []
    kept_shingles: list[tuple[str, frozenset[tuple[str, ...]]]] = []
    skipped: list[Hit] = []
    per_document: dict[str, int] = {}
    for hit in hits:
        if len(kept) == k:
            break
        taken = per_document.get(hit.document_key, 0)
        if max_per_document is not None and taken >= max_per_document:
            skipped.append(hit)
            continue
        shingles = word_trigrams(hit.text) if near_duplicate is not None else frozenset()
        if near_duplicate is not None and any(
                key != hit.document_key and jaccard(shingles, other) >= near_duplicate
                for key, other in kept_shingles):
            skipped.append(hit)
            continue
        per_document[hit.document_key] = taken + 1
        kept.append(hit)
        kept_shingles.append((hit.document_key, shingles))
    # Fillers go after every hit the rules kept: another page beats a repeat.
    return kept + skipped[:k - len(kept)]


def word_trigrams(text: str) -> frozenset[tuple[str, ...]]:
    """The lowercased word trigrams of `text` (its words, when it has fewer than three)."""
    words = _WORD.findall(text.lower())
    if len(words) < 3:
        return frozenset({tuple(words)}) if words else frozenset()
    return frozenset(zip(words, words[1:], words[2:], strict=False))


def jaccard(a: frozenset, b: frozenset) -> float:
    """|a ∩ b| / |a ∪ b|; 0 for two empty sets (nothing to repeat)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0
