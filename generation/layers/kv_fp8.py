"""FP8 (e4m3) KV cache values: per-tensor scales, saturating quantization and dequantization (torch reference).

A cache stored as float8_e4m3fn holds `q = clamp(x / scale, -448, 448)` rounded to e4m3; the real
value is `q * scale`, with one fp32 scale per layer for K and one for V (ModelRunner.kv_scales).
Values beyond the e4m3 range saturate to +-448 instead of becoming NaN (e4m3fn has no infinity).
Many torch ops have no float8 kernel on CPU (index_copy_, equal): the helpers here move float8
bytes through uint8 views, which every op supports and which copy the bytes unchanged.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(t: torch.Tensor) -> bool:
    """Whether `t` is stored as e4m3 (an FP8 KV cache)."""
    return t.dtype == FP8_KV_DTYPE


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale rounded to e4m3, saturated at +-448 (never inf or NaN for finite x).

    Args:
        x: values in any float dtype.
        scale: a positive fp32 scale (a tensor that broadcasts against x, or a number).

    Returns:
        A float8_e4m3fn tensor shaped like x.
    """
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """The fp32 values an e4m3 tensor stands for: q * scale."""
    return q.to(torch.float32) * scale


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an FP8 tensor (unchanged for other dtypes): index and copy ops work on every dtype."""
    return t.view(torch.uint8) if is_fp8(t) else t


def gather_values(cache: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache[index] as values: an FP8 cache gathered as bytes and dequantized to fp32, else as it is stored.

    Args:
        cache: a layer's k_cache or v_cache, or any tensor indexed along dim 0.
        index: an int64 index tensor for dim 0.
        scale: the cache's scale (required when the cache is FP8; ignored otherwise).
    """
    if not is_fp8(cache):
        return cache[index]
    assert scale is not None, "an FP8 KV cache needs its scale"
    return dequantize_fp8(cache.view(torch.uint8)[index].view(FP8_KV_DTYPE), scale)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Write rows of values into cache rows `slots` (the cache viewed as [rows, ...]), quantizing for FP8.

    Args:
        cache: a contiguous [num_blocks, block_size, Hkv, D] cache.
        slots: int64 row numbers.
        values: [len(slots), Hkv, D].
        scale: the cache's scale (required when the cache is FP8).
    """
    rows = cache.view(-1, *cache.shape[2:])  # view(), not reshape(): the copy must land in the cache itself
    if not is_fp8(cache):
        rows.index_copy_(0, slots, values.to(cache.dtype))
        return
    assert scale is not None, "an FP8 KV cache needs its scale"
    rows.view(torch.uint8).index_copy_(0, slots, quantize_fp8(values, scale).view(torch.uint8))
