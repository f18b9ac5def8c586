"""Triton kernels for the paged KV cache: store, varlen prefill and split-K decode (CUDA only)."""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

# Same API and cache layout as generation.layers.paged_attention, which imports this module only
# for CUDA tensors. Scores are kept in the log2 domain (q·k * scale * log2 e) so the softmax uses
# exp2, the GPU's native exponential. Page numbers are widened to int64 before they are scaled to
# element offsets: a large cache has more than 2**31 elements.

_LOG2E = 1.4426950408889634

_PREFILL_ROWS = 128  # query rows (token, head) per prefill program
_PREFILL_KEYS = 64  # keys per prefill iteration
_DECODE_KEYS = 64  # keys per decode iteration
# Aim for this many decode programs per SM before splitting the context. Measured on an H200, batch 1,
# Llama-8B heads: 4 gave 39 us at a 32k context against 48 us with 2, the same at 512 and 4096 tokens.
_DECODE_SPLIT_TARGET = 4


# --------------------------------------------------------------------------------------------------
# store_kvcache
# --------------------------------------------------------------------------------------------------


@triton.jit
def _store_kvcache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim, one cache slot
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # A -1 slot (padding) masks every lane instead of branching, so no host sync is ever needed.
    mask = (offs < ROW) & (slot >= 0)
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v ([num_tokens, num_kv_heads, head_dim]) into cache slots; slot -1 skips the token."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim)
    row = num_kv_heads * head_dim
    # Rows may be strided (k, v are usually slices of a fused qkv output), each row must be dense.
    if k.stride(2) != 1 or k.stride(1) != head_dim:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != head_dim:
        v = v.contiguous()
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row)
    )


# --------------------------------------------------------------------------------------------------
# Online-softmax step shared by prefill and decode
# --------------------------------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    cache_ptr, pages, k_pos, kv_head, stride_b, stride_s, stride_h, offs_d, mask, BLOCK_SIZE: tl.constexpr
):
    """Gather [BLOCK_N, BLOCK_D] rows of one KV head for key positions k_pos through their pages."""
    row = pages * stride_b + (k_pos % BLOCK_SIZE) * stride_s + kv_head * stride_h
    return tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _attend_tile(q, k, v, m_i, l_i, acc, visible, scale_log2, IEEE: tl.constexpr):
    """Fold one tile of keys into the running (max, sum, acc) of every query row."""
    if IEEE:  # fp32 inputs: full-precision products (TF32 would differ from the reference visibly)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing visible yet keep m = -inf; a finite stand-in avoids (-inf) - (-inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------------------
# Prefill: varlen flash attention, keys read through the block table
# --------------------------------------------------------------------------------------------------


@triton.jit
def _find_sequence(cu_seqlens_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles include `tile`.

    Sequence i's tiles start at cu_seqlens[i] // BLOCK_Q + i, an upper bound on the tiles of the
    sequences before it, so the grid needs no host-side maximum (no sync) and this binary search
    over the B + 1 boundaries finds the owner.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs is not specialised: as the constant 1 it would break the loop-carried type in _find_sequence.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * GROUP, a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache page size
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_ptr + seq)
    n_new = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= n_new:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - n_new

    # Rows are (token, head) pairs: the GROUP query heads of this KV head for BLOCK_Q tokens, so
    # each K/V tile loaded serves all of them (GQA) and short chunks still fill the MMA rows.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    token = local_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (token < n_new)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = prefix + token  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Keys before the tile's first token are visible to every row: no causal mask needed there.
    first_pos = prefix + local_tile * BLOCK_Q
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for k_start in range(0, full_end, BLOCK_N):
        k_pos = k_start + offs_n
        pages = tl.load(table + k_pos // BLOCK_SIZE).to(tl.int64)
        k = _load_kv_tile(k_cache_ptr, pages, k_pos, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
                          d_ok[None, :], BLOCK_SIZE)  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, pages, k_pos, kv_head, stride_vb, stride_vs, stride_vh, offs_d,
                          d_ok[None, :], BLOCK_SIZE)  # fmt: skip
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, row_ok[:, None], scale_log2, IEEE)

    # The diagonal: keys up to the tile's last token, causally masked per row.
    kv_end = tl.minimum(first_pos + BLOCK_Q, ctx)
    for k_start in range(full_end, kv_end, BLOCK_N):
        k_pos = k_start + offs_n
        k_ok = k_pos < kv_end
        pages = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = _load_kv_tile(k_cache_ptr, pages, k_pos, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, pages, k_pos, kv_head, stride_vb, stride_vs, stride_vh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, visible, scale_log2, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


def _prepare(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """Shared checks of both attention entry points: (q with unit head stride, empty output,
    block_size, num_kv_heads, query heads per KV head)."""
    num_heads = q.shape[1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if q.stride(2) != 1:  # the kernels index the head dimension with stride 1
        q = q.contiguous()
    return q, torch.empty_like(q, memory_format=torch.contiguous_format), block_size, num_kv_heads, group


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed new tokens to their cached prefix and each other (see paged_attention)."""
    q, out, block_size, num_kv_heads, group = _prepare(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(_PREFILL_ROWS, triton.next_power_of_2(group))
    block_q = block_m // group
    # Tile i of sequence s is program cu_seqlens[s] // block_q + s + i: at most this many programs.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=_PREFILL_KEYS,
        IEEE=q.dtype == torch.float32,
        num_warps=8 if head_dim > 64 else 4, num_stages=2,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# Decode: split-K (flash-decoding) over the context, then a reduce across splits
# --------------------------------------------------------------------------------------------------


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale_log2,
    tokens_per_split,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (the MMA's minimum rows)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # write partial (max, sum, acc) for the reduce kernel, else the output
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    # One program serves the GROUP query heads of one KV head, so each K/V byte is read once.
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for k_start in range(start, end, BLOCK_N):
        k_pos = k_start + offs_n
        k_ok = k_pos < end
        pages = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = _load_kv_tile(k_cache_ptr, pages, k_pos, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        v = _load_kv_tile(v_cache_ptr, pages, k_pos, kv_head, stride_vb, stride_vs, stride_vh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, k_ok[None, :], scale_log2, IEEE)

    if SPLIT:
        # Partials are [B, num_heads, num_splits] (+ [head_dim]); an empty split stores (-inf, 0, 0).
        part = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=g_ok)
        tl.store(part_l_ptr + part, l_i, mask=g_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip
    else:
        # A row with no context (a padded batch slot) gets zeros rather than 0/0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    part = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)  # fmt: skip
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.math.exp2(m - m_max)  # 0 for empty splits (m = -inf)
    total = tl.sum(weight * l_s, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)  # fmt: skip


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter (TRITON_INTERPRET=1): assume an H100/H200
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode launch.

    Splits only when batch * KV heads programs would leave SMs idle, and never below one key tile
    per split. Depends only on shapes (never on context_lens), so CUDA graphs can capture it.
    """
    chunks = max(1, math.ceil(max_tokens / _DECODE_KEYS))
    wanted = math.ceil(_DECODE_SPLIT_TARGET * _num_sms(device) / max(1, batch * num_kv_heads))
    num_splits = max(1, min(chunks, wanted))
    tokens_per_split = math.ceil(chunks / num_splits) * _DECODE_KEYS
    return math.ceil(max_tokens / tokens_per_split), tokens_per_split


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence ([B, num_heads, head_dim]) attending to its context_lens[i] cached tokens."""
    q, out, block_size, num_kv_heads, group = _prepare(q, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    num_splits, tokens_per_split = decode_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, q.device)
    split = num_splits > 1
    if split:
        part_m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused by the kernel when SPLIT is off
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, context_lens, block_tables,
        scale * _LOG2E, tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=_DECODE_KEYS,
        SPLIT=split, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    if split:
        _decode_reduce_kernel[(batch, num_heads)](
            out, part_m, part_l, part_acc, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
