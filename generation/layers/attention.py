"""Attention over a contiguous KV cache with grouped-query heads (plain torch reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and which keys each query may see.

    All rows of a batch share one cache layout (prompts are left-padded to the same length), so
    a single `start` index says where the step's S new tokens are written.
    """

    start: int  # cache index of the first new token
    mask: torch.Tensor  # [B, 1, S, start + S] bool, True = the query may attend to that key


def causal_mask(batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """A [B, 1, S, S] mask for unpadded prompts without a cache."""
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return mask.expand(batch_size, 1, seq_len, seq_len)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Write k, v into the cache, then attend q to every cached key the mask allows.

    Args:
        q: [B, Hq, S, D] queries (rotary already applied).
        k, v: [B, Hkv, S, D] keys and values of the new tokens.
        meta: cache position and visibility mask of this step.
        kv_cache: ([B, Hkv, T_max, D], same) for this layer, or None for a cache-free forward.

    Returns:
        [B, Hq, S, D] attention output.
    """
    if kv_cache is not None:
        k_cache, v_cache = kv_cache
        end = meta.start + k.shape[2]
        k_cache[:, :, meta.start : end] = k
        v_cache[:, :, meta.start : end] = v
        k, v = k_cache[:, :, :end], v_cache[:, :, :end]
    batch, num_heads, seq_len, head_dim = q.shape
    group = num_heads // k.shape[1]
    # Grouped-query attention without copying K/V per query head: the `group` query heads that
    # share a KV head are stacked along the sequence axis (row g*S + s), so each KV head is read
    # once. Hugging Face orders heads KV-major (head h uses KV head h // group), as this reshape
    # assumes.
    q = q.reshape(batch, k.shape[1], group * seq_len, head_dim)
    mask = meta.mask.repeat(1, 1, group, 1) if group > 1 else meta.mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(batch, num_heads, seq_len, head_dim)
