"""Few-row matmuls (decode at small batch) in Triton, and the measured choice between them and cuBLAS."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

# At batch 1 a decode step is one pass over the weights, so every matmul is a matrix-vector
# product bound by memory bandwidth. Whether cuBLAS or this kernel streams a given weight shape
# faster depends on the GPU and library version, so `choose` times both once per shape and the
# faster one serves every call with at most MAX_ROWS rows.
MAX_ROWS = 16
# A win smaller than this is within the timing's run-to-run spread (1-2% on an H200): cuBLAS keeps
# the shape. Seen there: a run that moved the qkv shape to Triton for a 1% win decoded 5% slower.
MIN_GAIN = 0.03


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int = 4
    split_k: int = 1  # programs per column block, each over a slice of K (the FP8 kernel only)


# Narrow column blocks give many programs (several resident per SM, so waves stay even); deep
# pipelines keep 32-64 KB of weights in flight per SM, about what HBM3e needs to stay busy.
CANDIDATES = (
    SkinnyConfig(16, 256, 4),
    SkinnyConfig(32, 256, 4),
    SkinnyConfig(16, 512, 3),
    SkinnyConfig(32, 128, 6),
)

# (N, K, dtype) -> the config that beat cuBLAS, or None where cuBLAS won.
_choices: dict[tuple[int, int, torch.dtype], SkinnyConfig | None] = {}


# M not specialised: one binary serves every row count (the value 1 would otherwise get its own).
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Rows padded to 16, the MMA's minimum: the matrix units idle, but the loads feeding tl.dot
    # are what Triton pipelines (num_stages deep), which keeps enough weight bytes in flight.
    BLOCK_M: tl.constexpr = 16
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) for M <= MAX_ROWS, fp32 accumulation; into `out` [M, N] when given."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1
    _skinny_gemm_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_stages=config.num_stages, num_warps=config.num_warps,
    )  # fmt: skip
    return out


def choice_for(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig | None:
    """The Triton config that serves x @ weight.T, or None for cuBLAS (not measured, too many rows, not 2-D)."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or not x.is_cuda or x.stride(1) != 1:
        return None
    return _choices.get((weight.shape[0], weight.shape[1], weight.dtype))


def choose(weights: list[torch.Tensor]) -> None:
    """Time cuBLAS and each candidate config on every distinct weight shape; remember the winners.

    Timed as a decode step runs them: one CUDA graph calls the kernel on every weight of the shape
    in turn (each layer's own matrix, so the L2 holds none of them), and the replay's time is
    divided by the calls. Flushing the L2 between eager calls instead (triton's do_bench) leaves
    it full of dirty lines and adds launch gaps; choices made that way were seen to slow decode.
    Both at 1 and MAX_ROWS rows: the kernel serves every count in between, so it must win at both.
    """
    groups: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
    for w in weights:
        key = (w.shape[0], w.shape[1], w.dtype)
        if key not in _choices and w.dtype in (torch.bfloat16, torch.float16):
            groups.setdefault(key, []).append(w)
    for key, ws in groups.items():
        n, k, _ = key
        best: tuple[float, SkinnyConfig | None] = (float("inf"), None)
        times = {}
        for rows in (1, MAX_ROWS):
            x = torch.randn(rows, k, dtype=ws[0].dtype, device=ws[0].device)
            times[("cublas", rows)] = _time([functools.partial(torch.nn.functional.linear, x, w) for w in ws])
            for c in CANDIDATES:
                times[(c, rows)] = _time([functools.partial(skinny_gemm, x, w, None, c) for w in ws])
        for config in CANDIDATES:
            worst = max(times[(config, r)] / times[("cublas", r)] for r in (1, MAX_ROWS))
            if worst < 1.0 - MIN_GAIN and times[(config, 1)] < best[0]:
                best = (times[(config, 1)], config)
        _choices[key] = best[1]
        size = n * k * ws[0].element_size()
        ours = best[0] if best[1] is not None else min(times[(c, 1)] for c in CANDIDATES)
        logger.info(
            "matmul %dx%d at 1 row (%d weights): cuBLAS %.1f us (%.0f GB/s), Triton best %.1f us (%.0f GB/s): %s",
            n, k, len(ws), times[("cublas", 1)] * 1e3,
            size / (times[("cublas", 1)] * 1e-3) / 1e9, ours * 1e3, size / (ours * 1e-3) / 1e9,
            "Triton " + str(best[1]) if best[1] is not None else "cuBLAS",
        )  # fmt: skip


def _time(calls: list) -> float:
    """Median milliseconds per call of `calls`, run back to back in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # compile, and let cuBLAS pick its kernels, outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return sorted(times)[len(times) // 2]
