"""RMSNorm as Llama defines it (normalise in fp32, scale in the model dtype), alone or after a residual add."""

from __future__ import annotations

import torch
from torch import nn

from generation.layers.kernel_choice import triton_fused_for


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale and no bias."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = triton_fused_for(x)
        if fused is not None:
            return fused.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        # Same op order as the reference (fp32 variance, cast back, then scale) so that bf16/fp16
        # results match Hugging Face bit for bit as far as possible.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's next value and its normalised form.

        The fused kernel writes the sum into `residual` itself; use the returned residual either way.
        """
        fused = triton_fused_for(x)
        if fused is not None and residual.is_contiguous() and x.stride(-1) == 1:
            width = x.shape[-1]
            normed, _ = fused.rms_norm(x.reshape(-1, width), self.weight, self.eps, residual.view(-1, width))
            return normed.view(x.shape), residual
        residual = x + residual
        return self(residual), residual
