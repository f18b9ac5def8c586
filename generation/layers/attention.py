"""Attention for one step: paged KV cache (rotate, store, prefill and/or decode kernel) or a dense pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from generation.layers.kernel_choice import triton_fused_for
from generation.layers.paged_attention import paged_decode_attention, paged_prefill_attention, store_kvcache
from generation.layers.rotary import RopeInputs, apply_rotary


class KVCache(NamedTuple):
    """One layer's paged KV cache: views of ModelRunner.kv_cache, and their scales when it is FP8.

    An FP8 (e4m3) cache stores x / scale; k_scale and v_scale are then [1] fp32 views of
    ModelRunner.kv_scales that the kernels read by pointer (so a CUDA graph sees new values). A
    cache in the model's dtype has no scales.
    """

    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    k_scale: torch.Tensor | None = None  # [1] fp32, FP8 caches only
    v_scale: torch.Tensor | None = None  # [1] fp32, FP8 caches only


def layer_kv_caches(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> list[KVCache]:
    """The per-layer caches of the engine's KV tensor.

    Args:
        kv_cache: [layers, 2, blocks, block_size, Hkv, D], K at index 0 of dim 1, V at 1.
        kv_scales: [layers, 2] fp32 (K, V) for an FP8 cache, else None.
    """
    if kv_scales is None:
        return [KVCache(layer[0], layer[1]) for layer in kv_cache]
    assert kv_scales.shape == (kv_cache.shape[0], 2) and kv_scales.dtype == torch.float32
    pairs = zip(kv_cache, kv_scales, strict=True)
    return [KVCache(layer[0], layer[1], scales[0:1], scales[1:2]) for layer, scales in pairs]


@dataclass
class AttentionMetadata:
    """Where a step's packed tokens go in the paged KV cache and what each one attends to.

    The step's T tokens belong to B sequences, packed back to back. A decode step (`is_prefill`
    False) has exactly one token per sequence and uses the decode kernel. A step with prompt
    chunks (`is_prefill`) may start with `num_decodes` one-token decodes, which the decode kernel
    serves too; the sequences after them go through the varlen prefill kernel.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1 = do not store)
    context_lens: torch.Tensor  # [B] int32, cached prefix + new tokens of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, physical blocks, padded with -1
    # Prefill only, over the sequences after the decodes: [B - num_decodes + 1] int32, the i-th
    # such sequence owns rows num_decodes + [cu_seqlens_q[i], cu_seqlens_q[i + 1]).
    cu_seqlens_q: torch.Tensor | None = None
    num_decodes: int = 0


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: RopeInputs,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Rotate q and k, store this step's k, v in the cache, then attend q to each sequence's whole context.

    Args:
        q: [T, Hq, D] queries; k, v: [T, Hkv, D] keys and values of the new tokens (not rotated).
        rope: the step's positions with the rotary tables (torch path) or the cos/sin table the
            fused kernel reads.
        kv_cache: this layer's cache (with its scales when it is FP8: k is quantized with k_scale, v
            with v_scale, and the kernels dequantize what they read).
        meta: the step's layout.
        scale: softmax scale.

    Returns:
        [T, Hq, D] attention output.
    """
    k_cache, v_cache, k_scale, v_scale = kv_cache
    fused = triton_fused_for(q) if rope.cos_sin is not None else None
    if fused is not None:
        # One kernel rotates q and k and stores k and v: the rotated k only ever lives in the cache.
        assert rope.cos_sin is not None
        q = fused.rotary_store_kvcache(q, k, v, rope.positions, rope.cos_sin, k_cache, v_cache, meta.slot_mapping,
                                       k_scale, v_scale)  # fmt: skip
    else:
        assert rope.tables is not None, "the torch path needs the rotary tables"
        q, k = apply_rotary(q, k, *rope.tables)  # rope tables [T, 1, D] broadcast over heads
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if not meta.is_prefill:
        return paged_decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables, scale, **scales)
    assert meta.cu_seqlens_q is not None
    nd = meta.num_decodes
    if nd == 0:
        return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                                       scale, **scales)  # fmt: skip
    # Decodes riding along with prompt chunks: the decode kernel reads their context at full
    # bandwidth, where the prefill kernel's query tiles would be almost all padding.
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    paged_decode_attention(q[:nd], k_cache, v_cache, meta.context_lens[:nd], meta.block_tables[:nd], scale,
                           out=out[:nd], **scales)  # fmt: skip
    paged_prefill_attention(q[nd:], k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens[nd:],
                            meta.block_tables[nd:], scale, out=out[nd:], **scales)  # fmt: skip
    return out


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over whole unpadded rows without a cache (the form parity tests compare to HF).

    Args:
        q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] (grouped-query: Hq is a multiple of Hkv).

    Returns:
        [B, Hq, S, D].
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
