"""Re-rotation of cached keys: move already-rotated K from position p to p + delta without the raw K.

RoPE rotates each pair i of a key by the angle omega_i * p, and rotations compose: R(a) R(b) =
R(a + b). So RoPE(k, p + delta) = R(omega_i * delta) RoPE(k, p) exactly whenever the frequency
vector omega depends on neither the position nor the sequence length. That holds for the
"default", "linear" and "llama3" schemes (`rope_inv_freq` is one fixed vector for a model), and
not for dynamic-NTK, LongRoPE or YaRN-style schemes, which `check_rerotatable` refuses.

The rotation is done once by delta, in fp32, then cast back to the cache dtype: one rounding,
where un-rotating and re-rotating in bf16 (as LMCache does) would round twice. An FP8 cache's keys
are dequantized with their layer's K scale, rotated in fp32 and quantized again with the same
scale (one e4m3 rounding); its values are copied as bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from generation.layers.kv_fp8 import FP8_KV_DTYPE, dequantize_fp8, is_fp8, quantize_fp8

# Schemes whose frequency vector is fixed per model (see the module docstring).
REROTATABLE_ROPE_TYPES = ("default", "linear", "llama3")


def check_rerotatable(scaling: dict[str, Any]) -> None:
    """Raise ValueError unless keys rotated under this rope scaling can be moved by a delta exactly.

    Raises:
        ValueError: a rope_type whose frequencies depend on the position or the length.
    """
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in REROTATABLE_ROPE_TYPES:
        raise ValueError(
            f"chunk KV reuse needs a RoPE scheme with fixed frequencies ({', '.join(REROTATABLE_ROPE_TYPES)}); "
            f"{rope_type!r} depends on the position or the length, so moving cached keys is not exact: "
            'use kv_reuse="exact"'
        )


def rerotate_keys(k: torch.Tensor, inv_freq: torch.Tensor, delta: int) -> torch.Tensor:
    """Keys rotated at position p, moved to position p + delta, in k's dtype.

    Args:
        k: [..., D] keys already rotated in the "rotate half" layout (the engine's cache layout:
            the first D / 2 channels pair with the last D / 2).
        inv_freq: [D / 2] fp32, the model's `rope_inv_freq` (scaling applied).
        delta: positions to move by (any sign; 0 returns an unchanged copy).

    Returns:
        A new tensor shaped like k.
    """
    if delta == 0:
        return k.clone()
    half = k.shape[-1] // 2
    # The angle in fp32 from an exact integer delta: the same product RotaryEmbedding forms.
    angle = float(delta) * inv_freq.to(device=k.device, dtype=torch.float32)
    cos, sin = angle.cos(), angle.sin()
    kf = k.float()
    x1, x2 = kf[..., :half], kf[..., half:]
    # Pair (x1, x2) rotated by the angle: the same formula as apply_rotary's x*cos + rotate_half(x)*sin.
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(k.dtype)


def copy_blocks_rerotated(
    kv_cache: torch.Tensor,
    copies: list[tuple[int, int, int]],
    inv_freq: torch.Tensor,
    k_scales: torch.Tensor | None = None,
) -> None:
    """Copy KV blocks within the cache (every layer), keys moved by each copy's delta: the torch path.

    One gather and one scatter per distinct delta (a chunk's blocks share one), not per block. The
    CUDA path, `triton_kv_copy.copy_rerotate_blocks`, does the same in one launch.

    Args:
        kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim]; K is index 0, V index 1.
        copies: (source block, destination block, delta); sources are only read.
        inv_freq: [head_dim / 2] fp32, the model's RoPE frequencies (scaling applied).
        k_scales: [layers] fp32, each layer's K scale, for an FP8 (e4m3) cache (None otherwise).
    """
    fp8 = is_fp8(kv_cache)
    assert (k_scales is not None) == fp8, "an FP8 cache, and only it, takes its K scales"
    by_delta: dict[int, list[tuple[int, int]]] = {}
    for src, dst, delta in copies:
        by_delta.setdefault(delta, []).append((src, dst))
    with torch.inference_mode():
        for delta, pairs in by_delta.items():
            src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=kv_cache.device)
            dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=kv_cache.device)
            if not fp8:
                kv_cache[:, 1, dst] = kv_cache[:, 1, src]
                kv_cache[:, 0, dst] = rerotate_keys(kv_cache[:, 0, src], inv_freq, delta)
                continue
            assert k_scales is not None
            cache_bytes = kv_cache.view(torch.uint8)  # float8 has no CPU index kernels; bytes move unchanged
            cache_bytes[:, 1, dst] = cache_bytes[:, 1, src]
            if delta == 0:
                cache_bytes[:, 0, dst] = cache_bytes[:, 0, src]
                continue
            scale = k_scales.to(torch.float32).reshape(-1, 1, 1, 1, 1)  # [layers] over [layers, n, bs, Hkv, D]
            keys = dequantize_fp8(cache_bytes[:, 0, src].view(FP8_KV_DTYPE), scale)
            cache_bytes[:, 0, dst] = quantize_fp8(rerotate_keys(keys, inv_freq, delta), scale).view(torch.uint8)
