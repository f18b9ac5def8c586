"""Attention over a paged KV cache: torch reference (CPU path, test oracle) and backend dispatch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from generation.layers.kernel_choice import triton_attention_for, triton_available
from generation.layers.kv_fp8 import gather_values, is_fp8, store_rows

# Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]. The
# token at position p of sequence i lives in slot block_tables[i, p // block_size] * block_size +
# p % block_size, i.e. row `slot` of the cache viewed as [num_blocks * block_size, num_kv_heads,
# head_dim]. Query head h reads KV head h // (num_heads // num_kv_heads).
#
# An FP8 cache (float8_e4m3fn) stores x / scale, one fp32 scale per layer for K (k_scale) and one
# for V (v_scale), each a [1] tensor the kernels read by pointer; stores quantize (saturating at
# +-448), attention dequantizes what it reads. Caches in the model's dtype take no scales.


# --------------------------------------------------------------------------------------------------
# Dispatch: Triton kernels on CUDA when Triton imports, the torch reference otherwise.
# --------------------------------------------------------------------------------------------------


def attention_backend(device: torch.device | str) -> str:
    """Which backend serves tensors on `device`: "triton" or "torch"."""
    return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v ([num_tokens, num_kv_heads, head_dim]) into cache slots; slot -1 skips the token.

    An FP8 cache needs k_scale and v_scale ([1] fp32): it stores k / k_scale and v / v_scale.
    """
    _check_scales(k_cache, k_scale, v_scale)
    backend = triton_attention_for(k)
    if backend is not None:
        backend.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens to their sequences' cached prefix and to each other.

    Args:
        q: [total_new_tokens, num_heads, head_dim], the new tokens of B sequences packed back to back.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], already holding the
            K/V of every token of every sequence, the new ones included (see store_kvcache).
        cu_seqlens_q: [B + 1] int32, sequence i's new tokens are q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]].
        context_lens: [B] int32, all tokens of sequence i (cached prefix + new).
        block_tables: [B, max_blocks] int32, physical blocks of each sequence (padding -1).
        scale: softmax scale, usually 1 / sqrt(head_dim).
        out: where to write the result (a [total_new_tokens, num_heads, head_dim] view with
            unit head-dim stride), else a new tensor.
        k_scale, v_scale: [1] fp32 scales of an FP8 cache (values = stored * scale); None otherwise.

    Returns:
        [total_new_tokens, num_heads, head_dim] in q's dtype (`out` when given).
    """
    _check_scales(k_cache, k_scale, v_scale)
    backend = triton_attention_for(q)
    if backend is not None:
        return backend.paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                               out=out, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    return _into(out, paged_prefill_attention_torch(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                                    scale, k_scale, v_scale))  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence ([B, num_heads, head_dim]) attending to its context_lens[i] cached tokens.

    `out`, when given, receives the result; k_scale, v_scale are an FP8 cache's scales (as in
    paged_prefill_attention).
    """
    _check_scales(k_cache, k_scale, v_scale)
    backend = triton_attention_for(q)
    if backend is not None:
        return backend.paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, out=out,
                                              k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    return _into(out, paged_decode_attention_torch(q, k_cache, v_cache, context_lens, block_tables, scale,
                                                   k_scale, v_scale))  # fmt: skip


def _check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    # Cheap (no device access): an FP8 cache read or written without its scales would be off by them.
    assert (k_scale is not None and v_scale is not None) == is_fp8(cache), "FP8 caches, and only they, take scales"


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


# --------------------------------------------------------------------------------------------------
# Torch reference
# --------------------------------------------------------------------------------------------------


def store_kvcache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference store_kvcache: an index_copy_ into the cache viewed as one row per slot (quantized for FP8)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    store_rows(k_cache, slots, k[keep], k_scale)
    store_rows(v_cache, slots, v[keep], v_scale)


def paged_prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference paged_prefill_attention: per sequence, gather its K/V and run masked attention in fp32.

    An FP8 cache's K/V are dequantized to fp32 (stored * scale) before attending.
    """
    out = torch.empty_like(q)
    # One host transfer for all bounds (a sync on CUDA, which the reference accepts).
    starts = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    block_size = k_cache.shape[1]
    for i, ctx in enumerate(ctx_lens):
        start, end = starts[i], starts[i + 1]
        n_new = end - start
        if n_new == 0:
            continue
        assert 0 < n_new <= ctx, "context_lens must count the new tokens too"
        num_blocks = -(-ctx // block_size)
        blocks = block_tables[i, :num_blocks].long()
        k = gather_values(k_cache, blocks, k_scale).flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = gather_values(v_cache, blocks, v_scale).flatten(0, 1)[:ctx]
        # New token j sits at absolute position ctx - n_new + j and sees keys 0 .. that position.
        q_pos = torch.arange(ctx - n_new, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n_new, ctx]
        out[start:end] = _attend(q[None, start:end], k[None], v[None], mask[None], scale)[0]
    return out


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference paged_decode_attention: gathers the whole batch's blocks at once, masks past each length.

    An FP8 cache's K/V are dequantized to fp32 (stored * scale) before attending.
    """
    block_size = k_cache.shape[1]
    tables = block_tables
    if not q.is_cuda:
        # Trim the table to the longest context so padding columns cost nothing. Skipped on CUDA,
        # where reading the lengths would sync and break CUDA-graph capture.
        tables = tables[:, : -(-int(context_lens.max()) // block_size)]
    # Padding entries (-1) point at block 0; the length mask hides whatever they hold.
    pages = tables.clamp(min=0).long()
    k = gather_values(k_cache, pages, k_scale).flatten(1, 2)  # [B, max_blocks * block_size, Hkv, D]
    v = gather_values(v_cache, pages, v_scale).flatten(1, 2)
    k_pos = torch.arange(k.shape[1], device=q.device)
    mask = k_pos[None, :] < context_lens[:, None]  # [B, T]
    return _attend(q[:, None], k, v, mask[:, None], scale)[:, 0]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked grouped-query attention in fp32.

    Args:
        q: [B, n, Hq, D]; k, v: [B, T, Hkv, D]; mask: [B, n, T] bool, True = visible.

    Returns:
        [B, n, Hq, D] in q's dtype.
    """
    batch, n, num_heads, head_dim = q.shape
    num_kv_heads, t = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    # Stack the `group` query heads of each KV head along the query axis (row g * n + j), so each
    # KV head is read once instead of being repeated per query head.
    qf = q.float().reshape(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qf = qf.reshape(batch, num_kv_heads, group * n, head_dim)
    kf = k.float().transpose(1, 2)  # [B, Hkv, T, D]
    vf = v.float().transpose(1, 2)
    m = mask[:, None, None].expand(batch, 1, group, n, t).reshape(batch, 1, group * n, t)
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=m, scale=scale)  # [B, Hkv, G * n, D]
    o = o.reshape(batch, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(batch, n, num_heads, head_dim).to(q.dtype)
