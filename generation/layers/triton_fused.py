"""Triton kernels that fuse the small per-token ops of a decoder layer: norms, rotary + KV store, SiLU-and-mul."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation.layers.kv_fp8 import FP8_MAX, is_fp8
from generation.layers.triton_common import kv_scale_args, quantize_kv

# Each kernel replaces a chain of torch ops (RMSNorm alone is eight): at decode batch sizes every
# op is a launch that moves a few KB, so a layer's ~37 launches cost more than its weight reads
# would allow. Numerics follow the torch reference op by op (fp32 math, rounding to the model
# dtype where torch rounds), so outputs stay within a rounding step of it.


# --------------------------------------------------------------------------------------------------
# RMSNorm, optionally after adding the residual
# --------------------------------------------------------------------------------------------------


@triton.jit
def add_and_norm_row(
    x_ptr, res_ptr, w_ptr, row, stride_x, stride_r, cols, ok, n_cols, eps, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One row's RMSNorm in the model dtype (x's), after adding the residual row and writing the sum
    back into it; also the body of triton_fp8_fused's norm that quantizes its output."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # residual = x + residual in the model dtype (as torch adds), written back in place.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)).to(
            x_ptr.dtype.element_ty
        )
        tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return (w * normed).to(x_ptr.dtype.element_ty)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    y = add_and_norm_row(x_ptr, res_ptr, w_ptr, row, stride_x, stride_r, cols, ok, n_cols, eps, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [T, H] rows, or of x + residual (the sum written into `residual`): (normed, residual)."""
    assert x.dim() == 2 and x.stride(1) == 1
    num_rows, n_cols = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out, residual
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, residual


# --------------------------------------------------------------------------------------------------
# SiLU(gate) * up
# --------------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    # torch rounds silu(gate) to the model dtype before the product, and the product again.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I] (a fused gate/up projection's output); returns [T, I]."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_rows, n_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](
        x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4
    )
    return out


# --------------------------------------------------------------------------------------------------
# Rotary embedding of q and k, with k and v stored into the paged KV cache
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    """Rotate the two halves [heads, D/2] as torch does in the model dtype: x * cos + rotate_half(x) * sin."""
    a1 = (x1 * cos).to(dtype).to(tl.float32)
    b1 = (-x2 * sin).to(dtype).to(tl.float32)
    a2 = (x2 * cos).to(dtype).to(tl.float32)
    b2 = (x1 * sin).to(dtype).to(tl.float32)
    return (a1 + b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
    v_scale_ptr, max_pos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr,  # an e4m3 cache: store rotated k / k_scale and v / v_scale
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    # Rows past the table only come from discarded lookahead steps; clamping keeps their reads in bounds.
    pos = tl.minimum(tl.load(pos_ptr + token), max_pos - 1).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]

    h = tl.arange(0, BLOCK_H)
    q_mask = (h < NUM_HEADS)[:, None] & d_ok[None, :]
    q_row = q_ptr + token * stride_qt + h[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_row, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + HALF, mask=q_mask, other=0.0).to(tl.float32)
    r1, r2 = _rotate(q1, q2, cos, sin, dtype)
    o_row = q_out_ptr + token * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(o_row, r1, mask=q_mask)
    tl.store(o_row + HALF, r2, mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    hk = tl.arange(0, BLOCK_KV)
    # A -1 slot (padding) masks every lane instead of branching, so no host sync is ever needed.
    kv_mask = (hk < NUM_KV_HEADS)[:, None] & d_ok[None, :] & (slot >= 0)
    k_row = k_ptr + token * stride_kt + hk[:, None] * stride_kh + d[None, :]
    k1 = tl.load(k_row, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_row + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    r1, r2 = _rotate(k1, k2, cos, sin, dtype)
    # The rotated k is rounded to the model dtype first (as the torch path's apply_rotary does), then quantized.
    r1 = quantize_kv(r1, k_scale_ptr, FP8_KV, FP8_MAX)
    r2 = quantize_kv(r2, k_scale_ptr, FP8_KV, FP8_MAX)
    # Cache rows are [num_kv_heads, head_dim] per slot, dense.
    c_row = slot * (NUM_KV_HEADS * 2 * HALF) + hk[:, None] * (2 * HALF) + d[None, :]
    tl.store(k_cache_ptr + c_row, r1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_cache_ptr + c_row + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v_row = v_ptr + token * stride_vt + hk[:, None] * stride_vh + d[None, :]
    v1 = tl.load(v_row, mask=kv_mask, other=0.0)
    v2 = tl.load(v_row + HALF, mask=kv_mask, other=0.0)
    v1 = quantize_kv(v1, v_scale_ptr, FP8_KV, FP8_MAX)
    v2 = quantize_kv(v2, v_scale_ptr, FP8_KV, FP8_MAX)
    tl.store(v_cache_ptr + c_row, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(v_cache_ptr + c_row + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rotary_store_kvcache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k by their positions, store rotated k and v in the cache slots; returns the rotated q.

    Args:
        q: [T, Hq, D], k, v: [T, Hkv, D]; rows may be strided (slices of a fused qkv output),
            each head's D values dense.
        positions: [T] int64.
        cos_sin: [max_positions, D] in q's dtype: cos of each position's D / 2 angles, then their
            sin (RotaryEmbedding.cos_sin_table; the "rotate half" layout).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous.
        slot_mapping: [T] int64 cache slot of each token, -1 to store nothing.
        k_scale, v_scale: an FP8 (e4m3) cache's [1] fp32 scales: it stores rotated k / k_scale and
            v / v_scale, saturated at +-448 (as `store_kvcache_torch`). None for other caches.

    Returns:
        [T, Hq, D] contiguous, in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert cos_sin.is_contiguous() and cos_sin.shape[1] == head_dim and cos_sin.dtype == q.dtype
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    half = head_dim // 2
    k_scale_arg, v_scale_arg = kv_scale_args(k_cache, k_scale, v_scale)
    _rotary_store_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin, out, k_cache, v_cache, slot_mapping, k_scale_arg, v_scale_arg, cos_sin.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        FP8_KV=is_fp8(k_cache), FP8_MAX=FP8_MAX, num_warps=4,
    )  # fmt: skip
    return out
