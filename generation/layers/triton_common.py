"""Shared pieces of the Triton paged-attention kernels: KV tile loads, the online-softmax step, launch checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Scores are kept in the log2 domain (q·k * scale * log2 e) so the softmax uses exp2, the GPU's
# native exponential. Page numbers are widened to int64 before they are scaled to element
# offsets: a large cache has more than 2**31 elements.
LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------------
# Online-softmax step shared by prefill and decode
# --------------------------------------------------------------------------------------------------


@triton.jit
def load_kv_tile(
    cache_ptr, pages, k_pos, kv_head, stride_b, stride_s, stride_h, offs_d, mask, BLOCK_SIZE: tl.constexpr
):
    """Gather [BLOCK_N, BLOCK_D] rows of one KV head for key positions k_pos through their pages."""
    row = pages * stride_b + (k_pos % BLOCK_SIZE) * stride_s + kv_head * stride_h
    return tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def widen_kv(x, dtype: tl.constexpr, FP8_KV: tl.constexpr):
    """A KV tile in the queries' dtype for the dot: an e4m3 tile converted (exactly: every e4m3 value is
    a bf16, fp16 and fp32 value), others as they are. The scales are applied outside (see the kernels)."""
    if FP8_KV:
        x = x.to(tl.float32).to(dtype)
    return x


@triton.jit
def quantize_kv(x, scale_ptr, FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr):
    """For an e4m3 cache, x / scale in fp32 saturated to +-FP8_MAX (the store's cast then rounds it to
    e4m3, never to NaN); x unchanged for other caches."""
    if FP8_KV:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x


@triton.jit
def attend_tile(q, k, v, m_i, l_i, acc, visible, scale_log2, IEEE: tl.constexpr):
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


def kv_scale_args(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V scale pointers a kernel takes: an FP8 cache's [1] fp32 scales, else the cache itself
    (never read: the kernels' FP8_KV constexpr is off)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache, cache
    assert k_scale is not None and v_scale is not None, "an FP8 KV cache needs its scales"
    assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32
    assert k_scale.device == cache.device and v_scale.device == cache.device
    return k_scale, v_scale


def prepare_attention_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """Shared checks of both attention entry points: (q with unit head stride, the output (`out` or
    a new tensor), block_size, num_kv_heads, query heads per KV head)."""
    num_heads = q.shape[1]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if q.stride(2) != 1:  # the kernels index the head dimension with stride 1
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    return q, out, block_size, num_kv_heads, group
