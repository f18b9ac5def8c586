"""Retrieval metrics over one ranked list of hits, by source: first relevant rank, recall@k, MRR, nDCG@k.

A ranked list holds one label per hit, best first (several hits may come from one source).
A hit matches a relevant label when it is that source, or a record of it (`file.jsonl#id`
matches the label `file.jsonl`). Each relevant source is credited once, at its first hit, so
recall and nDCG never exceed 1 however many chunks of one source come back.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence


def matches(key: str, label: str) -> bool:
    """Whether a hit's source key is the labelled source, or one of its records."""
    return key == label or key.partition("#")[0] == label


def credited(ranked: Sequence[str], relevant: Collection[str]) -> list[str | None]:
    """For each rank, the relevant label first credited there (None: no new relevant source)."""
    seen: set[str] = set()
    out: list[str | None] = []
    for key in ranked:
        label = next((lab for lab in relevant if lab not in seen and matches(key, lab)), None)
        if label is not None:
            seen.add(label)
        out.append(label)
    return out


def first_relevant_rank(ranked: Sequence[str], relevant: Collection[str]) -> int | None:
    """1-based rank of the first hit from a relevant source, None if none comes back."""
    for rank, key in enumerate(ranked, 1):
        if any(matches(key, label) for label in relevant):
            return rank
    return None


def recall_at(ranked: Sequence[str], relevant: Collection[str], k: int) -> float:
    """Share of the relevant sources with at least one hit in the top k (NaN when nothing is relevant)."""
    if not relevant:
        return math.nan
    return sum(label is not None for label in credited(ranked[:k], relevant)) / len(relevant)


def reciprocal_rank(ranked: Sequence[str], relevant: Collection[str]) -> float:
    """1 / rank of the first relevant hit; 0 when none comes back (NaN when nothing is relevant)."""
    if not relevant:
        return math.nan
    rank = first_relevant_rank(ranked, relevant)
    return 0.0 if rank is None else 1.0 / rank


def ndcg_at(ranked: Sequence[str], grades: Mapping[str, int], k: int) -> float:
    """Normalised discounted cumulative gain of the top k, with linear gains (trec_eval's).

    DCG = sum of grade / log2(rank + 1) over the ranks where a relevant source is first hit;
    the ideal DCG puts the highest grades at ranks 1, 2, ... NaN when nothing is relevant.
    """
    positive = {label: g for label, g in grades.items() if g > 0}
    if not positive:
        return math.nan
    dcg = sum(positive[label] / math.log2(rank + 1)
              for rank, label in enumerate(credited(ranked[:k], positive), 1) if label is not None)
    ideal = sorted(positive.values(), reverse=True)[:k]
    idcg = sum(g / math.log2(rank + 1) for rank, g in enumerate(ideal, 1))
    return dcg / idcg
