"""Triton kernels for the paged KV cache: store and varlen prefill here, split-K decode re-exported (CUDA only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation.layers.attention_splits import PREFILL_KEYS as _PREFILL_KEYS
from generation.layers.attention_splits import prefill_num_splits, prefill_tile
from generation.layers.kv_fp8 import FP8_MAX, is_fp8
from generation.layers.triton_common import (
    LOG2E,
    attend_tile,
    kv_scale_args,
    load_kv_tile,
    prepare_attention_inputs,
    quantize_kv,
    widen_kv,
)
from generation.layers.triton_decode import (  # noqa: F401  (the backend's decode entry points)
    DECODE_SPLIT_TARGET,
    decode_num_splits,
    decode_reduce_kernel,
    paged_decode_attention,
)

# Same API and cache layout as generation.layers.paged_attention, which imports this module only
# for CUDA tensors.

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
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim, one cache slot
    BLOCK: tl.constexpr,
    FP8_KV: tl.constexpr,  # the cache is e4m3: store x / scale, saturated
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # A -1 slot (padding) masks every lane instead of branching, so no host sync is ever needed.
    mask = (offs < ROW) & (slot >= 0)
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + offs, mask=mask)
    k = quantize_kv(k, k_scale_ptr, FP8_KV, FP8_MAX)
    v = quantize_kv(v, v_scale_ptr, FP8_KV, FP8_MAX)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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

    An FP8 cache stores k / k_scale and v / v_scale ([1] fp32 tensors, read on the device).
    """
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
    fp8 = is_fp8(k_cache)
    k_scale_arg, v_scale_arg = kv_scale_args(k_cache, k_scale, v_scale)
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale_arg, v_scale_arg, k.stride(0), v.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row), FP8_KV=fp8, FP8_MAX=FP8_MAX,
    )  # fmt: skip


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
# The other per-step integers are not either, so that a new step shape compiles nothing (see
# _decode_kernel).
_UNSPECIALISED = ["num_seqs", "tokens_per_split", "num_splits", "stride_bt", "cu_seqlens_ptr", "context_lens_ptr",
                  "block_tables_ptr"]  # fmt: skip


@triton.jit(do_not_specialize=_UNSPECIALISED)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    num_seqs,
    tokens_per_split,
    num_splits,
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
    NUM_HEADS: tl.constexpr,
    SPLIT: tl.constexpr,  # write partial (max, sum, acc) per row for the reduce kernel, else the output
    IEEE: tl.constexpr,
    FP8_KV: tl.constexpr,  # the cache is e4m3: K/V widened to q's dtype, K scale in the scores, V scale on acc
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
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
    if FP8_KV:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)  # q . (k * k_scale) = (q . k) * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Keys before the tile's first token are visible to every row: no causal mask needed there.
    # With SPLIT, this program sees only keys [split_start, split_end) of both ranges (the split
    # bounds are multiples of BLOCK_N, so the tiles stay aligned).
    first_pos = prefix + local_tile * BLOCK_Q
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(first_pos + BLOCK_Q, ctx)
    split_start = split * tokens_per_split
    split_end = split_start + tokens_per_split
    for k_start in range(split_start, tl.minimum(full_end, split_end), BLOCK_N):
        k_pos = k_start + offs_n
        pages = tl.load(table + k_pos // BLOCK_SIZE).to(tl.int64)
        k = load_kv_tile(k_cache_ptr, pages, k_pos, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
                          d_ok[None, :], BLOCK_SIZE)  # fmt: skip
        v = load_kv_tile(v_cache_ptr, pages, k_pos, kv_head, stride_vb, stride_vs, stride_vh, offs_d,
                          d_ok[None, :], BLOCK_SIZE)  # fmt: skip
        k = widen_kv(k, q.dtype, FP8_KV)
        v = widen_kv(v, q.dtype, FP8_KV)
        m_i, l_i, acc = attend_tile(q, k, v, m_i, l_i, acc, row_ok[:, None], scale_log2, IEEE)

    # The diagonal: keys up to the tile's last token, causally masked per row.
    for k_start in range(tl.maximum(full_end, split_start), tl.minimum(kv_end, split_end), BLOCK_N):
        k_pos = k_start + offs_n
        k_ok = k_pos < kv_end
        pages = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = load_kv_tile(k_cache_ptr, pages, k_pos, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        v = load_kv_tile(v_cache_ptr, pages, k_pos, kv_head, stride_vb, stride_vs, stride_vh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        k = widen_kv(k, q.dtype, FP8_KV)
        v = widen_kv(v, q.dtype, FP8_KV)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        m_i, l_i, acc = attend_tile(q, k, v, m_i, l_i, acc, visible, scale_log2, IEEE)

    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr)  # sum p (v * v_scale) = (sum p v) * v_scale, partials too
    if SPLIT:
        # Partials are [T, num_heads, num_splits] (+ [head_dim]), the decode reduce kernel's layout
        # with tokens for sequences; a split with no visible key stores (-inf, 0, 0).
        part = ((q_start + token).to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q_start + token).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


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
    """Causal attention of packed new tokens to their cached prefix and each other (see paged_attention).

    An FP8 cache needs its k_scale and v_scale ([1] fp32, read on the device).
    """
    q, out, block_size, num_kv_heads, group = prepare_attention_inputs(q, k_cache, v_cache, out)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, block_q = prefill_tile(group)
    # Tile i of sequence s is program cu_seqlens[s] // block_q + s + i: at most this many programs.
    programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    num_splits, tokens_per_split = prefill_num_splits(
        num_tokens, programs, block_tables.shape[1] * block_size, q.device
    )
    split = num_splits > 1
    if split:
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused by the kernel when SPLIT is off
    block_d = max(16, triton.next_power_of_2(head_dim))
    k_scale_arg, v_scale_arg = kv_scale_args(k_cache, k_scale, v_scale)
    _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, cu_seqlens_q, context_lens, block_tables,
        k_scale_arg, v_scale_arg, scale * LOG2E, num_seqs, tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=_PREFILL_KEYS,
        NUM_HEADS=num_heads, SPLIT=split, IEEE=q.dtype == torch.float32, FP8_KV=is_fp8(k_cache),
        num_warps=8 if head_dim > 64 else 4, num_stages=2,
    )  # fmt: skip
    if split:
        # Rows of tokens that belong to no sequence (padding past the last boundary) get no
        # partials and come out as garbage, as they would unsplit: nothing reads them.
        decode_reduce_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
