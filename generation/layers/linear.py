"""Linear: nn.Linear whose few-row products may run the Triton skinny matmul where it measured faster."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from generation.layers.kernel_choice import triton_fused_for


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) with a measured kernel choice for decode-sized inputs.

    Inputs of at most triton_skinny_gemm.MAX_ROWS rows on CUDA use the Triton kernel when
    `triton_skinny_gemm.choose` found it faster than cuBLAS for this weight shape; everything else is
    F.linear.
    """

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; `out` ([N, out], for 2-D x) receives the result when given."""
        fused = triton_fused_for(x)
        if fused is not None:
            from generation.layers import triton_skinny_gemm

            config = triton_skinny_gemm.choice_for(x, self.weight)
            if config is not None:
                return triton_skinny_gemm.skinny_gemm(x, self.weight, self.bias, config, out=out)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)
