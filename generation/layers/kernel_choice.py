"""Which kernels serve a tensor: Triton modules on CUDA when Triton imports, else the torch reference."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

# The fused kernels (norms, rotary + KV store, SiLU-and-mul, few-row matmuls, the reused-chunk KV
# copy) can be switched off
# to measure what they save or to bisect a numerical difference; attention always uses Triton on CUDA.
_fused_enabled = True
# The reused-chunk KV copy alone, for a benchmark's peer row (bench/rag_kv_reuse.py "+torch-copy").
_kv_copy_enabled = True
# FP8 layers' inputs quantized by their producers (RMSNorm, SiLU-and-mul) in the same kernel
# (triton_fp8_fused), for a benchmark's peer row (bench/engine_llama8b.py rag-prefill).
_fp8_producer_quant = True


def set_fused_kernels(enabled: bool) -> None:
    """Use (True, the default) or skip the fused Triton kernels for models run after this call.

    CUDA graphs keep the kernels they were captured with: set this before the engine is built.
    """
    global _fused_enabled
    _fused_enabled = enabled


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    """generation.layers.<name>, imported on first use so that CPU-only installs never load Triton."""
    try:
        return importlib.import_module(f"generation.layers.{name}")
    except ImportError:
        return None


def triton_attention_for(t: torch.Tensor) -> ModuleType | None:
    """The Triton attention kernels if they serve tensors like `t` (CUDA, Triton importable), else None."""
    return _triton_module("triton_attention") if t.is_cuda else None


def triton_fused_for(t: torch.Tensor) -> ModuleType | None:
    """The fused Triton kernels if they serve tensors like `t` and are switched on, else None."""
    return _triton_module("triton_fused") if t.is_cuda and _fused_enabled else None


def set_fp8_producer_quantize(enabled: bool) -> None:
    """Quantize FP8 layers' inputs inside the norm / SiLU-and-mul kernels (True, the default) or in
    a launch of their own. Prefill reads it at each step; decode graphs keep what they captured."""
    global _fp8_producer_quant
    _fp8_producer_quant = enabled


def fp8_producer_quantize() -> bool:
    return _fp8_producer_quant


def set_kv_copy_kernel(enabled: bool) -> None:
    """Copy reused chunk KV with the Triton kernel (True, the default, on CUDA) or the torch path."""
    global _kv_copy_enabled
    _kv_copy_enabled = enabled


def triton_kv_copy_for(t: torch.Tensor) -> ModuleType | None:
    """The one-launch copy of reused chunk KV blocks if it serves a cache like `t`, else None."""
    return _triton_module("triton_kv_copy") if t.is_cuda and _fused_enabled and _kv_copy_enabled else None


def triton_fp8_for(device: torch.device) -> ModuleType | None:
    """The FP8 matmul kernels (per-token quantization, few-row matmul) for a CUDA device, when fused kernels are on.

    Switching the fused kernels off leaves FP8 layers on the reference path (dequantize, matmul).
    """
    return _triton_module("triton_fp8") if device.type == "cuda" and _fused_enabled else None


def triton_available() -> bool:
    return _triton_module("triton_attention") is not None
