"""FP8 (e4m3) linear layers: per-output-channel weight scales, dynamic per-token activation scales.

The scheme of the published "FP8-dynamic" checkpoints (compressed-tensors `channel` weights,
`token` dynamic activations) and of `torch._scaled_mm`'s row-wise scaling: a weight row n is
stored as round_e4m3(w[n] / s_w[n]) with s_w[n] = max|w[n]| / 448, and each input row m is
quantised the same way when it arrives, s_x[m] = max|x[m]| / 448. The product is then

    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k]

which `fp8_linear_reference` computes in fp32 (the CPU path, and the reference the GPU kernels
are tested against) and, on GPUs with FP8 tensor cores (Ada, Hopper), `generation.layers.triton_fp8`:
a Triton per-token quantization and `torch._scaled_mm`, or at decode's few rows a Triton matmul
that streams the e4m3 weights against unquantized activations (`fp8_weight_only_reference` is its
product), whichever measured faster for the weight's shape.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row of zeros gets this scale instead of 0, so dividing by it is defined (and gives zeros).
MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., K] in e4m3, scale [...] fp32) with x ≈ q * scale[..., None], one scale per row.

    Each row's largest magnitude maps to 448, e4m3's largest finite value; rounding is to nearest
    (torch's cast). Used for weights (a row is an output channel) and activations (a row is a token).
    """
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8Rows(NamedTuple):
    """An activation already quantized per token by its producer (`triton_fp8_fused`): e4m3 rows
    q [T, K], their fp32 scales [T], and the model dtype the rows had (the layer's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale[..., None] in fp32."""
    return q.float() * scale.float().unsqueeze(-1)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: x quantised per token, both dequantised, an fp32 matmul."""
    lead = x.shape[:-1]
    qx, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = dequantize_rows(qx, sx) @ dequantize_rows(weight, weight_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, weight.shape[0])


def fp8_weight_only_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] @ dequant(weight).T in fp32 with x as it is: what the GPU's few-row kernel computes."""
    y = x.float().reshape(-1, x.shape[-1]) @ dequantize_rows(weight, weight_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores that torch._scaled_mm drives (CUDA, compute capability >= 8.9)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight in any float dtype as (e4m3 [N, K], fp32 scale [N]), computed on w's device.

    Done a slice of rows at a time so that the fp32 copy of a large matrix (a 70B layer's gate/up
    is 0.5 G elements) never exists whole.
    """
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    step = max(1, (1 << 26) // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        q[start : start + step], s[start : start + step] = quantize_rows(w[start : start + step])
    return q, s


class Fp8Linear(nn.Module):
    """A linear layer whose weight is e4m3 with one fp32 scale per output channel.

    Parameters: `weight` [N, K] (float8_e4m3fn), `weight_scale` [N] (fp32), `bias` [N] in the
    model's dtype or None. Not an nn.Linear on purpose: the bf16 kernel choices (the skinny matmul)
    must not see it, and `.to(dtype)` of the model must not cast its weight (build the model in
    its dtype first, then swap these in: `LlamaForCausalLM.create_empty`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self._dequantized: torch.Tensor | None = None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        if isinstance(x, Fp8Rows):  # rows its producer quantized (on a GPU: see takes_quantized_input)
            if x.q.is_cuda:
                from generation.layers import triton_fp8

                return triton_fp8.scaled_mm_rows(x, self.weight, self.weight_scale, self.bias)
            return self._reference(x.q, x.scale, x.dtype)
        if x.is_cuda and fp8_kernels_serve(x.device):
            from generation.layers import triton_fp8

            return triton_fp8.fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if not x.is_cuda:
            qx, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
            return self._reference(qx, sx, x.dtype).view(*x.shape[:-1], self.out_features)
        return fp8_linear_reference(x, self.weight, self.weight_scale, self.bias)

    def _reference(self, qx: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """CPU reference of quantized rows [T, K] -> [T, N] in `dtype`: the dequantized fp32 weight is
        kept after its first use (a CPU run is for checking numerics, and dequantizing every matrix at
        every step dominated it). Loading new weights in place (load_weights, fill_dummy_weights)
        happens before any forward."""
        if self._dequantized is None or self._dequantized.device != self.weight.device:
            self._dequantized = dequantize_rows(self.weight, self.weight_scale)
        y = dequantize_rows(qx, sx) @ self._dequantized.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(dtype)

    def takes_quantized_input(self, x: torch.Tensor) -> bool:
        """Whether this layer would quantize its T input rows per token itself (quantize + _scaled_mm),
        so that their producer may hand them over quantized instead (a fused kernel,
        `triton_fp8_fused`). `x` is that input or what it is made from ([T, ...], 2-D, on the GPU)."""
        from generation.layers.kernel_choice import fp8_producer_quantize

        if x.dim() != 2 or not x.is_cuda or not fp8_producer_quantize() or not fp8_kernels_serve(x.device):
            return False
        from generation.layers import triton_fp8

        return triton_fp8.takes_quantized(self.weight, x.shape[0])

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer multiplies by, in fp32 [N, K] (tests, quality comparisons)."""
        return dequantize_rows(self.weight, self.weight_scale)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, fp8 e4m3"


def fp8_kernels_serve(device: torch.device) -> bool:
    """FP8 kernels serve this device: FP8 tensor cores, and the Triton kernels importable and switched on."""
    from generation.layers.kernel_choice import triton_fp8_for

    return scaled_mm_supported(device) and triton_fp8_for(device) is not None


def fp8_layers(model: nn.Module) -> list[Fp8Linear]:
    """Every Fp8Linear of a model, in module order."""
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]
