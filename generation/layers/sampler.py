"""Sampler: greedy, temperature, top-k and top-p selection with per-request random generators."""

from __future__ import annotations

import torch

from generation.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: [B, V] next-token logits.
        params: one SamplingParams per row.
        generators: one generator per row (None = torch's global RNG); seeded requests own theirs
            so their draws do not depend on what else is in the batch.

    Returns:
        [B] int64 token ids on the logits' device.
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    for row, p in enumerate(params):
        if p.is_greedy:
            continue
        probs = _filtered_probs(logits[row], p)
        tokens[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
    return tokens


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p (removed tokens get probability 0)."""
    logits = logits / p.temperature
    if p.top_k == -1 and p.top_p >= 1.0:
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(descending=True)
    if p.top_k != -1:
        sorted_logits[p.top_k :] = float("-inf")
    if p.top_p < 1.0:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first token has
        # nothing above it, so at least one token always survives.
        above = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits[above >= p.top_p] = float("-inf")
    probs = torch.zeros_like(logits)
    probs[order] = torch.softmax(sorted_logits, dim=-1)
    return probs
