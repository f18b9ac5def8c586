"""Attention over a paged KV cache: torch reference (CPU path, test oracle) and backend dispatch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from generation.layers.kernel_choice import triton_attention_for, triton_available

# Cache layout, per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]. The
# token at position p of sequence i lives in slot block_tables[i, p // block_size] * block_size +
# p % block_size, i.e. row `slot` of the cache viewed as [num_blocks * block_size, num_kv_heads,
# head_dim]. Query head h reads KV head h // (num_heads // num_kv_heads).


# --------------------------------------------------------------------------------------------------
# Dispatch: Triton kernels on CUDA when Triton imports, the torch reference otherwise.
# --------------------------------------------------------------------------------------------------


def attention_backend(device: torch.device | str) -> str:
    """Which backend serves tensors on `device`: "triton" or "torch"."""
    return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v ([num_tokens, num_kv_heads, head_dim]) into cache slots; slot -1 skips the token."""
    backend = triton_attention_for(k)
    if backend is not None:
        backend.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
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

    Returns:
        [total_new_tokens, num_heads, head_dim] in q's dtype (`out` when given).
    """
    backend = triton_attention_for(q)
    if backend is not None:
        return backend.paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                               out=out)  # fmt: skip
    return _into(out, paged_prefill_attention_torch(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                                    scale))  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence ([B, num_heads, head_dim]) attending to its context_lens[i] cached tokens.

    `out`, when given, receives the result (as in paged_prefill_attention).
    """
    backend = triton_attention_for(q)
    if backend is not None:
        return backend.paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, out=out)
    return _into(out, paged_decode_attention_torch(q, k_cache, v_cache, context_lens, block_tables, scale))


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


# --------------------------------------------------------------------------------------------------
# Torch reference
# --------------------------------------------------------------------------------------------------


def store_kvcache_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference store_kvcache: an index_copy_ into the cache viewed as one row per slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # view(), not reshape(): the copy must land in the cache itself, so it has to be contiguous.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def paged_prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference paged_prefill_attention: per sequence, gather its K/V and run masked attention in fp32."""
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
        k = k_cache[blocks].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
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
) -> torch.Tensor:
    """Reference paged_decode_attention: gathers the whole batch's blocks at once, masks past each length."""
    block_size = k_cache.shape[1]
    tables = block_tables
    if not q.is_cuda:
        # Trim the table to the longest context so padding columns cost nothing. Skipped on CUDA,
        # where reading the lengths would sync and break CUDA-graph capture.
        tables = tables[:, : -(-int(context_lens.max()) // block_size)]
    # Padding entries (-1) point at block 0; the length mask hides whatever they hold.
    pages = tables.clamp(min=0).long()
    k = k_cache[pages].flatten(1, 2)  # [B, max_blocks * block_size, Hkv, D]
    v = v_cache[pages].flatten(1, 2)
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
