"""FP8 (e4m3) matmul kernels in Triton: per-token activation quantization, and a few-row matmul for decode.

Both follow `generation.layers.fp8`'s scheme (per-output-channel weight scales, dynamic per-token
activation scales) and its rounding: scale = amax / 448 in fp32, q = round_to_nearest(x / scale)
with an IEEE division, so a row quantizes to the same bytes as `fp8.quantize_rows` computes.

At decode's few rows a matmul is a pass over the weights, bound by their bytes, not by the matrix
units: `fp8_skinny_gemm` streams the e4m3 weights (half of bf16's bytes), widens them to the
activations' dtype in registers and leaves the activations unquantized (weight-only FP8, closer to
the bf16 product than the per-token path). A first version quantized the rows inside the launch
and used an fp8 `tl.dot`: 200-580 GB/s on an H100, 4-5x slower than quantize + `_scaled_mm`.
Which kernel serves a weight shape, this or quantize + `torch._scaled_mm`, is measured once per
shape (`choose`), as the bf16 skinny matmul is.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from generation.layers.fp8 import Fp8Rows
from generation.layers.triton_skinny_gemm import MIN_GAIN, SkinnyConfig, _time

logger = logging.getLogger(__name__)

# tl.constexpr: the only globals a Triton kernel may read.
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)
MAX_ROWS = 16


# The bf16 skinny matmul's winners (32 x 128, 6 stages) and the same bytes in flight with 1-byte
# weights; then deeper K tiles: with half the bytes per element a tile of the bf16 kernel's shape
# keeps half the bytes in flight (on an H100 on 2026-12-07 the down projection, K = 14,336, took
# 32 x 512 x 3; the other shapes kept 32 x 256 x 4).
CANDIDATES = (
    SkinnyConfig(32, 128, 6),
    SkinnyConfig(32, 256, 4),
    SkinnyConfig(16, 256, 4),
    SkinnyConfig(64, 128, 4),
    SkinnyConfig(16, 512, 4),
    SkinnyConfig(32, 512, 3),
    SkinnyConfig(16, 1024, 3),
    SkinnyConfig(64, 256, 4, 8),
    # Split over K: o and down have 128 column blocks of 32 (one program per SM, 3-6 tiles in flight
    # each) and qkv 192 (1.45 waves); two or four programs per block put more bytes in flight.
    SkinnyConfig(32, 256, 4, split_k=2),
    SkinnyConfig(32, 256, 4, split_k=4),
    SkinnyConfig(64, 256, 4, 8, split_k=2),
    SkinnyConfig(32, 512, 3, split_k=2),
)

# (N, K) -> the config that beat quantize + _scaled_mm at 1 and MAX_ROWS rows, or None.
_choices: dict[tuple[int, int], SkinnyConfig | None] = {}


# --------------------------------------------------------------------------------------------------
# Per-token quantization
# --------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        ok = start + cols < K
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)  # IEEE, as torch divides
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK):
        ok = start + cols < K
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(tl.float8e4nv), mask=ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] e4m3, scale [M] fp32) of a 2-D x with unit column stride: one launch, one program per row."""
    assert x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, q, s, x.stride(0), q.stride(0), k, BLOCK=block, num_warps=4)
    return q, s


def scaled_mm_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ dequant(weight [N, K]).T: per-token quantization here, then one torch._scaled_mm."""
    qx, sx = quantize_rows(x)
    return scaled_mm_rows(Fp8Rows(qx, sx, x.dtype), weight, weight_scale, bias)


def scaled_mm_rows(
    rows: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Per-token quantized rows [M, K] @ dequant(weight [N, K]).T in rows.dtype: one torch._scaled_mm."""
    # Row-wise scales give bf16 out (some torch versions take no other output dtype with them).
    y = torch._scaled_mm(rows.q, weight.t(), scale_a=rows.scale.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                         out_dtype=torch.bfloat16)  # fmt: skip
    if bias is not None:
        y = y + bias
    return y if y.dtype == rows.dtype else y.to(rows.dtype)


def takes_quantized(weight: torch.Tensor, rows: int) -> bool:
    """Whether `fp8_linear` quantizes `rows` input rows for this weight (quantize + _scaled_mm),
    rather than streaming it against them unquantized (the few-row kernel, where `choose` picked one)."""
    return rows > MAX_ROWS or _choices.get((weight.shape[0], weight.shape[1])) is None


# --------------------------------------------------------------------------------------------------
# Few-row matmul with the rows quantized in the same launch
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _fp8_skinny_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    # The bf16 skinny matmul with e4m3 weights: each weight tile is widened to x's dtype in
    # registers (exact: every e4m3 value is a bf16 value) and the channel scales applied to the
    # fp32 sums. Half the bytes of bf16 weights per step, and x is not quantized at all.
    # With SPLIT_K > 1, program (n, s) sums K_SPLIT columns of K from s * K_SPLIT and writes its
    # fp32 sums unscaled to partials [SPLIT_K, M, N] (out_ptr); _split_k_reduce_kernel finishes.
    BLOCK_M: tl.constexpr = 16
    split = tl.program_id(1)
    k_start = split * K_SPLIT  # K_SPLIT is a multiple of BLOCK_K
    k_len = tl.minimum(K - k_start, K_SPLIT)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_start + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k_start + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < k_len - k * BLOCK_K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w.to(tl.float32).to(x_ptr.dtype.element_ty), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT_K == 1:
        acc = acc * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + (split * M + offs_m[:, None]) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    p_ptr, ws_ptr, b_ptr, out_ptr, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # out[m] = (sum over splits of partials[s, m]) * channel scale (+ bias): the split kernel's epilogue.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + (s * M + row) * N + offs, mask=ok, other=0.0)
    acc = acc * tl.load(ws_ptr + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fp8_skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
    config: SkinnyConfig,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] (M <= MAX_ROWS, bf16/fp16) @ dequant(weight).T with x as it is (weight-only FP8, fp32 sums)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = config.split_k
    k_split = triton.cdiv(triton.cdiv(k, config.block_k), split) * config.block_k
    # Partial sums when split: fp32 [split, m, n] (64 KB at 16 rows of 4,096 columns, split 4).
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else weight_scale
    _fp8_skinny_kernel[(triton.cdiv(n, config.block_n), split)](
        x, weight, weight_scale, bias_arg, target, m, n, k, k_split,
        x.stride(0), weight.stride(0), target.stride(-2),
        HAS_BIAS=bias is not None, EVEN_K=k % (config.block_k * split) == 0, SPLIT_K=split,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_stages=config.num_stages, num_warps=config.num_warps,
    )  # fmt: skip
    if split > 1 and m:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            target, weight_scale, bias_arg, out, m, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


def _weight_only_product(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x @ dequant(weight).T in fp32, a slice of rows at a time (a 70B gate/up in fp32 is 0.9 GB)."""
    return torch.cat([x.float() @ (weight[i : i + 4096].float() * weight_scale[i : i + 4096, None]).t()
                      for i in range(0, weight.shape[0], 4096)], dim=1)  # fmt: skip


def _agrees(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a candidate's product is the reference's within 1% of max |ref|."""
    return bool((out.float() - ref).abs().max() <= 0.01 * ref.abs().max().clamp_min(1e-6))


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] @ dequant(weight).T on CUDA: the measured few-row kernel where it won, else _scaled_mm."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    config = _choices.get((weight.shape[0], weight.shape[1])) if x2.shape[0] <= MAX_ROWS else None
    if config is not None:
        y = fp8_skinny_gemm(x2, weight, weight_scale, bias, config)
    else:
        y = scaled_mm_linear(x2, weight, weight_scale, bias)
    return y.view(*lead, weight.shape[0])


def choose(layers: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
    """Time quantize + _scaled_mm against each few-row config on every (N, K) of `layers` (weight, scale).

    Timed like triton_skinny_gemm.choose: one CUDA graph calls every weight of a shape in turn, at
    1 and MAX_ROWS rows; a config must win at both by MIN_GAIN. A config Triton cannot compile on
    this GPU is skipped.
    """
    groups: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for w, s in layers:
        key = (w.shape[0], w.shape[1])
        if key not in _choices:
            groups.setdefault(key, []).append((w, s))
    for key, ws in groups.items():
        n, k = key
        device = ws[0][0].device
        times: dict[tuple[object, int], float] = {}
        usable = []
        xs = {rows: torch.randn(rows, k, dtype=dtype, device=device) for rows in (1, MAX_ROWS)}
        refs = {rows: _weight_only_product(x, *ws[0]) for rows, x in xs.items()}  # once, not per candidate
        for rows, x in xs.items():
            times[("cublas", rows)] = _time([functools.partial(scaled_mm_linear, x, w, s, None) for w, s in ws])
        for c in CANDIDATES:
            try:
                for rows, x in xs.items():
                    # A config that compiles but computes something else must never serve.
                    if not _agrees(fp8_skinny_gemm(x, *ws[0], None, c), refs[rows]):
                        raise ValueError("its product differs from the weight-only reference")
                    times[(c, rows)] = _time([functools.partial(fp8_skinny_gemm, x, w, s, None, c) for w, s in ws])
                usable.append(c)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is simply not a candidate
                logger.warning("fp8 skinny config %s not usable on this GPU: %s: %s", c, type(exc).__name__, exc)
        best: tuple[float, SkinnyConfig | None] = (float("inf"), None)
        for c in usable:
            worst = max(times[(c, r)] / times[("cublas", r)] for r in (1, MAX_ROWS))
            if worst < 1.0 - MIN_GAIN and times[(c, 1)] < best[0]:
                best = (times[(c, 1)], c)
        _choices[key] = best[1]
        size = n * k
        ours = best[0] if best[1] is not None else min((times[(c, 1)] for c in usable), default=float("nan"))
        logger.info(
            "fp8 matmul %dx%d at 1 row (%d weights): _scaled_mm %.1f us (%.0f GB/s), Triton best %.1f us "
            "(%.0f GB/s): %s",
            n, k, len(ws), times[("cublas", 1)] * 1e3, size / (times[("cublas", 1)] * 1e-3) / 1e9,
            ours * 1e3, size / (ours * 1e-3) / 1e9, "Triton " + str(best[1]) if best[1] is not None else "_scaled_mm",
        )  # fmt: skip


def choices() -> dict[tuple[int, int], SkinnyConfig | None]:
    """The measured choice per (N, K) so far (benchmarks print it)."""
    return dict(_choices)
