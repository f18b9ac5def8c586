"""Rotary position embeddings, with the "default", "linear" and "llama3" frequency schemes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies, shape [head_dim // 2], fp32, after the configured rope scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Dividing the frequency is dividing the position: positions are stretched by `factor`.
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_type {rope_type!r} is not supported; valid: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are scaled by `factor`, short ones kept, and the band in
    # between interpolated smoothly, so that short-range behaviour is untouched.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass
class RopeInputs:
    """What a step's attention layers need to rotate q and k.

    Either `tables` (cos and sin per token, applied with torch ops) or `cos_sin` (one row per
    position, which the fused Triton kernel indexes by `positions` itself) is set.
    """

    positions: torch.Tensor  # [T] or [B, S] int64
    tables: tuple[torch.Tensor, torch.Tensor] | None = None
    cos_sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Computes rotary cos/sin tables for positions, in the "rotate half" layout of Hugging Face."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any], max_positions: int = 8192) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, dict(scaling)
        self.max_positions = max_positions
        # Not persistent: derived from the config, never loaded from a checkpoint.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._cos_sin: dict[torch.dtype, torch.Tensor] = {}

    def reset_inv_freq(self) -> None:
        """Recompute the buffer in fp32 on its device (after `to_empty()` or a dtype cast)."""
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.inv_freq.device)
        self._cos_sin.clear()

    def cos_sin_table(self, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, D] in `dtype`: row p holds cos of position p's D / 2 angles, then their sin.

        Built once per dtype, on the first call (which must not be inside a CUDA graph capture),
        from the same fp32 angles and torch cos/sin as `forward`, so both give the same values.
        """
        table = self._cos_sin.get(dtype)
        if table is None:
            positions = torch.arange(self.max_positions, device=self.inv_freq.device)
            freqs = positions.to(torch.float32)[:, None] * self.inv_freq  # [P, D/2]
            table = torch.cat((freqs.cos().to(dtype), freqs.sin().to(dtype)), dim=-1).contiguous()
            self._cos_sin[dtype] = table
        return table

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [B, 1, S, D] in `dtype`, for positions [B, S]."""
        # Angles in fp32 whatever the model dtype: bf16 positions * freqs lose whole radians.
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, S, D] and k [B, Hkv, S, D] by the tables from RotaryEmbedding."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
