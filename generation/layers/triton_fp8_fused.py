"""FP8 activation quantization fused into its producers: RMSNorm (before qkv and gate/up) and
SiLU-and-mul (before down).

An FP8 layer that runs quantize + `torch._scaled_mm` (prefill, and decode batches above the few-row
kernel's 16 rows) quantizes its input per token. Done separately, that is the producer writing a
bf16 row, then `triton_fp8.quantize_rows` reading it twice and writing e4m3: for each token of a
layer 2 x 4,096 + 14,336 bf16 values written and read back twice, and three launches. Here the
producer computes its row as before, rounded to the model dtype exactly where the separate ops
round, and quantizes it in the same program, so the e4m3 bytes and scales equal
`fp8.quantize_rows(producer(x))` (the GPU tests compare bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from generation.layers.fp8 import FP8_DTYPE, Fp8Rows
from generation.layers.triton_fused import add_and_norm_row

FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, stride_x, stride_r, stride_q, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # triton_fused's norm of the row, then triton_fp8._quantize_rows_kernel's quantization of it.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    y = add_and_norm_row(x_ptr, res_ptr, w_ptr, row, stride_x, stride_r, cols, ok, n_cols, eps, HAS_RESIDUAL)
    y = y.to(tl.float32)  # the row the norm would write, in the model dtype
    y = tl.where(ok, y, 0.0)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=ok)


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Rows, torch.Tensor | None]:
    """(RMSNorm of x [T, H] quantized per row, residual): as `triton_fused.rms_norm`, whose bf16
    output is never written; with `residual`, x + residual is written into it first."""
    assert x.dim() == 2 and x.stride(1) == 1
    num_rows, n_cols = x.shape
    q = torch.empty(num_rows, n_cols, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        if residual is not None:
            assert residual.shape == x.shape and residual.stride(1) == 1
        block = triton.next_power_of_2(n_cols)
        _rms_norm_quant_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, q, s,
            x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return Fp8Rows(q, s, x.dtype), residual


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, n_cols, BLOCK: tl.constexpr):
    # One program per row, two passes over its columns: the amax of silu(gate) * up, then the row
    # again, quantized. The second pass reads what the first just read (in L2 for a 14,336-wide row).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        ok = start + cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + start + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)  # as triton_fused.silu_and_mul rounds
        amax = tl.maximum(amax, tl.where(ok, tl.abs(y), 0.0))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        ok = start + cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + start + cols, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(tl.float8e4nv), mask=ok)


def silu_and_mul_quant(x: torch.Tensor) -> Fp8Rows:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I], quantized per row: as `triton_fused.silu_and_mul`,
    whose bf16 output is never written."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    q = torch.empty(num_rows, n_cols, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        block = min(2048, triton.next_power_of_2(n_cols))
        _silu_and_mul_quant_kernel[(num_rows,)](x, q, s, x.stride(0), q.stride(0), n_cols, BLOCK=block, num_warps=8)
    return Fp8Rows(q, s, x.dtype)
