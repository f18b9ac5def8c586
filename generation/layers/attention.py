"""Attention for one step: paged KV cache (store, then prefill or decode kernel) or a cache-free dense pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from generation.layers.paged_attention import paged_decode_attention, paged_prefill_attention, store_kvcache

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


@dataclass
class AttentionMetadata:
    """Where a step's packed tokens go in the paged KV cache and what each one attends to.

    The step's T tokens belong to B sequences, packed back to back. A decode step (`is_prefill`
    False) has exactly one token per sequence and uses the decode kernel; any step with a prompt
    chunk uses the varlen prefill kernel, in which decodes ride along as 1-token entries.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1 = do not store)
    context_lens: torch.Tensor  # [B] int32, cached prefix + new tokens of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, physical blocks, padded with -1
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32, prefill only: sequence i owns rows [i], [i + 1]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's k, v in the cache, then attend q to each sequence's whole context.

    Args:
        q: [T, Hq, D] queries (rotary applied).
        k, v: [T, Hkv, D] keys and values of the new tokens.
        kv_cache: this layer's cache.
        meta: the step's layout.
        scale: softmax scale.

    Returns:
        [T, Hq, D] attention output.
    """
    k_cache, v_cache = kv_cache
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_prefill:
        assert meta.cu_seqlens_q is not None
        return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                                       scale)  # fmt: skip
    return paged_decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables, scale)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over whole unpadded rows without a cache (the form parity tests compare to HF).

    Args:
        q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] (grouped-query: Hq is a multiple of Hkv).

    Returns:
        [B, Hq, S, D].
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
