"""Triton split-K (flash-decoding) attention of one query per sequence over the paged KV cache (CUDA only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation.layers.attention_splits import DECODE_KEYS as _DECODE_KEYS
from generation.layers.attention_splits import DECODE_SPLIT_TARGET, decode_num_splits  # noqa: F401
from generation.layers.kv_fp8 import is_fp8
from generation.layers.triton_common import (
    LOG2E,
    attend_tile,
    kv_scale_args,
    load_kv_tile,
    prepare_attention_inputs,
    widen_kv,
)

# --------------------------------------------------------------------------------------------------
# Decode: split-K (flash-decoding) over the context, then a reduce across splits
# --------------------------------------------------------------------------------------------------


# Integer arguments that change from step to step are not specialised: by default Triton compiles
# a variant for each "== 1" and "% 16 == 0" pattern of them, so a split count or table width seen
# for the first time while serving stalled that step for a second or more (bench/rag_kv_reuse.py
# --trace-slow showed 1.4-2.5 s steps). What still varies (SPLIT, BLOCK_S) is compiled at start.
@triton.jit(do_not_specialize=["tokens_per_split", "num_splits", "stride_bt", "context_lens_ptr", "block_tables_ptr"])
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
    k_scale_ptr,
    v_scale_ptr,
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
    FP8_KV: tl.constexpr,  # the cache is e4m3: K/V widened to q's dtype, K scale in the scores, V scale on acc
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
    if FP8_KV:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)  # q . (k * k_scale) = (q . k) * k_scale

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for k_start in range(start, end, BLOCK_N):
        k_pos = k_start + offs_n
        k_ok = k_pos < end
        pages = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = load_kv_tile(k_cache_ptr, pages, k_pos, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        v = load_kv_tile(v_cache_ptr, pages, k_pos, kv_head, stride_vb, stride_vs, stride_vh, offs_d,
                          kv_mask, BLOCK_SIZE)  # fmt: skip
        k = widen_kv(k, q.dtype, FP8_KV)
        v = widen_kv(v, q.dtype, FP8_KV)
        m_i, l_i, acc = attend_tile(q, k, v, m_i, l_i, acc, k_ok[None, :], scale_log2, IEEE)

    if FP8_KV:
        acc = acc * tl.load(v_scale_ptr)  # sum p (v * v_scale) = (sum p v) * v_scale, partials too
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


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(
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

    An FP8 cache needs its k_scale and v_scale ([1] fp32, read on the device).
    """
    q, out, block_size, num_kv_heads, group = prepare_attention_inputs(q, k_cache, v_cache, out)
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
    k_scale_arg, v_scale_arg = kv_scale_args(k_cache, k_scale, v_scale)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, context_lens, block_tables,
        k_scale_arg, v_scale_arg, scale * LOG2E, tokens_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=_DECODE_KEYS,
        SPLIT=split, IEEE=q.dtype == torch.float32, FP8_KV=is_fp8(k_cache),
        num_warps=4, num_stages=3,
    )  # fmt: skip
    if split:
        decode_reduce_kernel[(batch, num_heads)](
            out, part_m, part_l, part_acc, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out
