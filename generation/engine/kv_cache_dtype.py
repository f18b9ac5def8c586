"""The KV cache's storage dtype (EngineConfig.kv_cache_dtype) and, for FP8, its per-layer K and V scales."""

from __future__ import annotations

import logging

import torch

from generation.layers.kv_fp8 import FP8_KV_DTYPE
from rag.errors import ModelError

logger = logging.getLogger(__name__)

# Scale of an FP8 cache whose checkpoint has no calibrated k_scale/v_scale: vLLM's default too.
# Activations of the usual models stay well inside e4m3's +-448 at this scale.
DEFAULT_FP8_KV_SCALE = 1.0


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV tensor is allocated in: the model's for "auto", float8_e4m3fn for "fp8".

    Raises:
        ValueError: another name (EngineConfig checks it first).
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; valid: auto, fp8")


def kv_cache_scales(
    model: torch.nn.Module, num_layers: int, kv_dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Per-layer K and V scales of an FP8 cache, [layers, 2] fp32 on `device` (0 = K, 1 = V); None otherwise.

    From the model's `kv_cache_scales` (set by the loader from a checkpoint's k_scale/v_scale)
    when it has them, else DEFAULT_FP8_KV_SCALE everywhere.

    Raises:
        ModelError: the model's scales are not [layers, 2], or not all finite and positive.
    """
    if kv_dtype != FP8_KV_DTYPE:
        return None
    given = getattr(model, "kv_cache_scales", None)
    if given is None:
        logger.info("FP8 KV cache without calibrated scales: K and V scale %.1f", DEFAULT_FP8_KV_SCALE)
        return torch.full((num_layers, 2), DEFAULT_FP8_KV_SCALE, dtype=torch.float32, device=device)
    scales = torch.as_tensor(given).detach().to(device=device, dtype=torch.float32).contiguous()
    if scales.shape != (num_layers, 2):
        raise ModelError(
            f"the model's KV cache scales are shaped {tuple(scales.shape)}, not [{num_layers}, 2] (layers, K/V): "
            "check the checkpoint's self_attn.k_scale/v_scale"
        )
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        raise ModelError(
            "the model's KV cache scales must be finite and positive: check the checkpoint's k_scale/v_scale"
        )
    return scales.clone()  # the engine's own tensor: the kernels read it by pointer for the engine's life
