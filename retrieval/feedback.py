"""Pseudo-relevance feedback for the dense leg: the query vector moved toward the best readable hits.

A chatty question ("an id column that counts up by itself") often lies far from the words the
answer uses; the first pass's best hits, though, mostly use the collection's own vocabulary, so a
second dense search from the query plus their mean vector (Rocchio, 1971) reaches pages the first
one missed. The second search is one more ranking to fuse, never a replacement: measured on the
PostgreSQL manual set, replacing the dense leg loses recall, fusing the feedback leg with it gains.

Only hits the caller already holds after the permission post-check may feed back: text the
principal may not read must not steer what they get (a feedback vector built from it would be a
leak through the ranking).
"""

from __future__ import annotations

import numpy as np

# Measured on the PostgreSQL manual and the sample set (docs/benchmarks.md): 3 or 5 hits with a
# weight of 0.3 to 0.5 all lift the manual alike; 5 and 0.5 was the one that kept the sample set's
# MRR too.
FEEDBACK_HITS = 5
FEEDBACK_WEIGHT = 0.5


def feedback_query(query: np.ndarray, passages: np.ndarray, weight: float = FEEDBACK_WEIGHT) -> np.ndarray:
    """The unit vector along `query + weight * mean(passages)`.

    Args:
        query: the question's embedding, (dim,), L2-normalized.
        passages: embeddings of the feedback texts, (n, dim), n >= 1, L2-normalized rows.
        weight: how far to move toward the passages (> 0).

    Returns:
        float32 (dim,), L2-normalized (the stores score by inner product).

    Raises:
        ValueError: no passages, mismatched dimensions, or weight <= 0.
    """
    if weight <= 0:
        raise ValueError(f"weight must be > 0, got {weight}")
    passages = np.asarray(passages, dtype=np.float32)
    query = np.asarray(query, dtype=np.float32)
    if passages.ndim != 2 or passages.shape[0] == 0 or passages.shape[1] != query.shape[-1]:
        raise ValueError(f"passages must be (n >= 1, {query.shape[-1]}), got {passages.shape}")
    moved = query + weight * passages.mean(axis=0)
    norm = float(np.linalg.norm(moved))
    # A query exactly opposite the passages' mean cancels out; the plain query is then the answer.
    return query if norm == 0.0 else (moved / norm).astype(np.float32)
