"""The relevance a person reads next to a citation: a calibrated 0-1 value, or None.

Stdlib only (rag.prompts builds citations with it; the CLI and API only display it).
"""

from __future__ import annotations

import math


def relevance(score: float, reranked: bool) -> float | None:
    """The probability that a hit is relevant, where the score supports one; else None.

    Args:
        score: the hit's raw score (`Hit.score`), which stays available as it is.
        reranked: whether `score` is the cross-encoder's.

    A reranked score is the cross-encoder's logit (for a 2-label model, logit[1] - logit[0]).
    The ms-marco cross-encoders (the packaged reranker) are trained with binary cross-entropy
    on relevant / not-relevant pairs, so sigmoid(logit) is their estimate of the probability of
    relevance; for a 2-label model, sigmoid(l1 - l0) is the softmax of the "relevant" label.
    Unreranked scores get None: a cosine similarity is not a probability (where unrelated texts
    land depends on the embedder; many put them well above 0), and BM25 and fused
    reciprocal-rank scores have no absolute scale at all; the citation's rank is shown instead.
    """
    if not reranked or not math.isfinite(score):
        return None
    # Written so that neither branch overflows for a large |score|.
    if score >= 0:
        return 1.0 / (1.0 + math.exp(-score))
    e = math.exp(score)
    return e / (1.0 + e)
