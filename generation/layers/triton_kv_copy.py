"""One Triton launch that copies reused chunk KV blocks and moves their keys by each block's delta.

The torch path (`rerotation.copy_blocks_rerotated`, used on CPU) does, per distinct delta, two
host-to-device index copies that wait for the stream, a gather, an fp32 widening, four products,
a concatenation, a narrowing and two scatters: a dozen launches and several fp32 temporaries of
the whole chunk's keys. A request that reuses four chunks pays that four times before its prefill
can start. Here every (source, destination, delta) triple of a step is one program per layer and
triple, reading each block once and writing it once, with the index triples sent asynchronously.

Numerics follow `rerotate_keys`: the angle is delta * inv_freq in fp32, its cosine and sine are
computed by torch (the same library calls, not Triton's approximations, which lose accuracy for
angles of thousands of radians), the rotation is done in fp32 and rounded once to the cache dtype.
The compiler may fuse a product and a difference into one FMA, so a result can differ from the
torch path's by the last fp32 bit before that rounding: the GPU test allows one ulp of the cache
dtype. An FP8 (e4m3) cache's keys are dequantized with the layer's K scale (read on the device),
rotated in fp32 and quantized again with it, saturated at +-448; its values are copied as bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation.layers.kv_fp8 import FP8_MAX, is_fp8


@triton.jit
def _copy_rerotate_kernel(
    kv_ptr, src_ptr, dst_ptr, cos_ptr, sin_ptr, k_scale_ptr,
    stride_layer, stride_kv, stride_block,
    ROWS: tl.constexpr, HALF: tl.constexpr, TILE_ROWS: tl.constexpr,
    FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    # Program (pair, layer): block `src` of this layer to block `dst`, keys rotated by the pair's angle.
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs_h = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pair * HALF + offs_h)[None, :]
    sin = tl.load(sin_ptr + pair * HALF + offs_h)[None, :]
    k_src = kv_ptr + layer * stride_layer + src * stride_block
    k_dst = kv_ptr + layer * stride_layer + dst * stride_block
    v_src = k_src + stride_kv
    v_dst = k_dst + stride_kv
    if FP8_KV:
        k_scale = tl.load(k_scale_ptr + layer)  # [layers] fp32
    # A block is ROWS = block_size x kv_heads rows of head_dim contiguous values.
    for start in range(0, ROWS, TILE_ROWS):
        rows = start + tl.arange(0, TILE_ROWS)
        first = rows[:, None] * (2 * HALF) + offs_h[None, :]
        m = (rows < ROWS)[:, None]
        x1 = tl.load(k_src + first, mask=m).to(tl.float32)
        x2 = tl.load(k_src + first + HALF, mask=m).to(tl.float32)
        if FP8_KV:
            x1 = x1 * k_scale
            x2 = x2 * k_scale
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if FP8_KV:
            y1 = tl.minimum(tl.maximum(y1 / k_scale, -FP8_MAX), FP8_MAX)
            y2 = tl.minimum(tl.maximum(y2 / k_scale, -FP8_MAX), FP8_MAX)
        tl.store(k_dst + first, y1.to(kv_ptr.dtype.element_ty), mask=m)
        tl.store(k_dst + first + HALF, y2.to(kv_ptr.dtype.element_ty), mask=m)
        tl.store(v_dst + first, tl.load(v_src + first, mask=m), mask=m)
        tl.store(v_dst + first + HALF, tl.load(v_src + first + HALF, mask=m), mask=m)


def copy_rerotate_blocks(
    kv_cache: torch.Tensor,
    copies: list[tuple[int, int, int]],
    inv_freq: torch.Tensor,
    k_scales: torch.Tensor | None = None,
) -> None:
    """Copy KV blocks within the cache, every layer, keys moved by each copy's position delta.

    Args:
        kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim], contiguous, on a CUDA device
            (or any device under TRITON_INTERPRET=1); K is index 0, V index 1.
        copies: (source block, destination block, delta); sources are only read, and no
            destination may be another copy's source (the block manager's copies land in a
            request's own fresh blocks).
        inv_freq: [head_dim / 2] fp32, the model's RoPE frequencies (scaling applied).
        k_scales: [layers] fp32 on the cache's device, each layer's K scale, for an FP8 (e4m3)
            cache (None otherwise).
    """
    fp8 = is_fp8(kv_cache)
    assert (k_scales is not None) == fp8, "an FP8 cache, and only it, takes its K scales"
    if not copies:
        return
    layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
    half = head_dim // 2
    assert two == 2 and kv_cache.is_contiguous() and half * 2 == head_dim
    assert half == triton.next_power_of_2(half), "head_dim / 2 must be a power of two"
    rows = block_size * kv_heads
    tile_rows = min(triton.next_power_of_2(rows), max(1, 4096 // half))
    device = kv_cache.device
    # One pinned host tensor sent without waiting for the stream: the torch path's per-delta
    # torch.tensor(..., device=cuda) copies each synchronise with the host.
    triples = torch.tensor(copies, dtype=torch.int64)
    if device.type == "cuda":
        triples = triples.pin_memory().to(device, non_blocking=True)
    else:
        triples = triples.to(device)
    src, dst, delta = triples.unbind(1)
    # The same fp32 angle and library cos/sin as rerotate_keys.
    angle = delta.to(torch.float32)[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()
    src, dst = src.contiguous(), dst.contiguous()
    if k_scales is not None:
        assert k_scales.shape == (layers,) and k_scales.dtype == torch.float32 and k_scales.device == device
        k_scales = k_scales.contiguous()  # a column of kv_scales [layers, 2] is strided
    _copy_rerotate_kernel[(len(copies), layers)](
        kv_cache, src, dst, cos, sin, k_scales if k_scales is not None else cos,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        ROWS=rows, HALF=half, TILE_ROWS=tile_rows, FP8_KV=fp8, FP8_MAX=FP8_MAX,
    )  # fmt: skip
