"""FP8 weight kernels on the GPU (per-token quantization, few-row matmul, _scaled_mm) against the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from generation.layers.fp8 import (
    Fp8Linear,
    dequantize_rows,
    fp8_linear_reference,
    fp8_weight_only_reference,
    quantize_rows,
    scaled_mm_supported,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not scaled_mm_supported(torch.device("cuda")),
        reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)",
    ),
]

# Shapes of the Llama-3.1-8B decoder (qkv, o, gate_up, down) and a ragged one.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (200, 96)]


@pytest.fixture(scope="module")
def kernels():
    from generation.layers import triton_fp8

    return triton_fp8


def _case(m: int, n: int, k: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 2.0).to(dtype)
    w = torch.randn(n, k, generator=gen) * 0.02
    qw, sw = quantize_rows(w)
    return x.cuda(), qw.cuda(), sw.cuda()


def _assert_within_fp8_gemm_error(out: torch.Tensor, ref: torch.Tensor, x, qw, sw) -> None:
    """out within the error an FP8 GEMM may add to the fp32 reference on the same e4m3 operands.

    Hopper's FP8 tensor cores accumulate with fewer bits than fp32 between cuBLAS's promotions, so
    the error scales with the sum of |terms| (|x| @ |w|.T), not with |y|: 2e-3 of it, plus the bf16
    rounding of the output.
    """
    l1 = x.float().cpu().abs() @ dequantize_rows(qw.cpu(), sw.cpu()).abs().t()
    err = (out.float().cpu() - ref.float()).abs()
    bound = 2e-3 * l1 + ref.float().abs() / 128 + 1e-3
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error {worst:.2f}x the FP8 GEMM bound"


def _assert_close_to_reference(out: torch.Tensor, x, qw, sw, bias=None) -> None:
    ref = fp8_linear_reference(x.cpu().float(), qw.cpu(), sw.cpu(), None if bias is None else bias.cpu().float())
    _assert_within_fp8_gemm_error(out, ref, x, qw, sw)


@pytest.mark.parametrize("m", [1, 7, 16, 300])
def test_triton_quantize_rows_gives_the_same_bytes_and_scales_as_torch(kernels, m):
    x, _, _ = _case(m, 8, 4096, seed=m)
    q, s = kernels.quantize_rows(x)
    q_ref, s_ref = quantize_rows(x.cpu())
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_few_row_kernel_matches_the_reference(kernels, m, n, k):
    x, qw, sw = _case(m, n, k, seed=n + m)
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    # Weight-only FP8: x is not quantized, so the reference is x @ dequant(w).T in fp32; bf16
    # products are exact in the fp32 sums, so only the sum order and the output rounding differ.
    ref = fp8_weight_only_reference(x.cpu().float(), qw.cpu(), sw.cpu(), bias.cpu().float())
    for config in kernels.CANDIDATES:
        out = kernels.fp8_skinny_gemm(x, qw, sw, bias, config)
        torch.testing.assert_close(out.float().cpu(), ref.to(torch.bfloat16).float(), atol=1e-3, rtol=1 / 128)


@pytest.mark.parametrize(("n", "k"), [SHAPES[1], SHAPES[4]])
def test_few_row_kernel_with_fp16_activations_matches_the_reference(kernels, n, k):
    # Weights widen to the activations' dtype: fp16 models take the same kernel.
    x, qw, sw = _case(4, n, k, seed=n, dtype=torch.float16)
    ref = fp8_weight_only_reference(x.cpu().float(), qw.cpu(), sw.cpu(), None)
    for config in kernels.CANDIDATES:
        out = kernels.fp8_skinny_gemm(x, qw, sw, None, config)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float().cpu(), ref.to(torch.float16).float(), atol=1e-3, rtol=1 / 512)


@pytest.mark.parametrize(("n", "k"), SHAPES[:4])
@pytest.mark.parametrize("m", [1, 16, 512])
def test_scaled_mm_path_matches_the_reference(kernels, m, n, k):
    x, qw, sw = _case(m, n, k, seed=3 * n + m)
    _assert_close_to_reference(kernels.scaled_mm_linear(x, qw, sw, None), x, qw, sw)


def test_choose_measures_every_shape_and_the_chosen_kernel_is_correct(kernels):
    layers = [_case(1, n, k, seed=i)[1:] for i, (n, k) in enumerate(SHAPES[:2])]
    kernels.choose(layers, torch.bfloat16)
    picked = kernels.choices()
    assert set(picked) >= {(6144, 4096), (4096, 4096)}
    x, qw, sw = _case(3, 6144, 4096, seed=11)
    out = kernels.fp8_linear(x, qw, sw, None)
    if picked[(6144, 4096)] is None:  # quantize + _scaled_mm: the per-token reference
        _assert_close_to_reference(out, x, qw, sw)
    else:  # the few-row kernel: weight-only FP8, x as it is
        ref = fp8_weight_only_reference(x.cpu().float(), qw.cpu(), sw.cpu(), None)
        torch.testing.assert_close(out.float().cpu(), ref.to(torch.bfloat16).float(), atol=1e-3, rtol=1 / 128)


def test_fp8_model_on_the_gpu_gives_the_cpu_reference_logits(tiny_model_factory, monkeypatch):
    from generation.loader import load_model

    path, _ = tiny_model_factory("default")
    gpu, _ = load_model(path, torch.device("cuda"), torch.bfloat16, quantization="fp8")
    cpu, _ = load_model(path, torch.device("cpu"), torch.float32, quantization="fp8")
    assert isinstance(gpu.model.layers[0].mlp.down_proj, Fp8Linear)
    assert torch.equal(gpu.model.layers[1].self_attn.qkv_proj.weight.cpu().view(torch.uint8),
                       cpu.model.layers[1].self_attn.qkv_proj.weight.view(torch.uint8))  # fmt: skip
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 64, 12, 100, 101, 7, 7, 7, 55]])
    with torch.no_grad():
        a = gpu.compute_logits(gpu(ids.cuda())).float().cpu()  # 14 rows: the _scaled_mm path
        b = cpu.compute_logits(cpu(ids)).float()
        # One row through the few-row kernel (as if choose() had picked it for every shape).
        from generation.layers import triton_fp8
        from generation.layers.fp8 import fp8_layers

        saved = triton_fp8.choices()
        triton_fp8._choices.update({tuple(m.weight.shape): triton_fp8.CANDIDATES[0] for m in fp8_layers(gpu)})
        try:
            a1 = gpu.compute_logits(gpu(ids[:, :1].cuda())).float().cpu()
        finally:
            triton_fp8._choices.clear()
            triton_fp8._choices.update(saved)
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.995, f"GPU FP8 logits drifted from the CPU reference: cosine {cos:.4f}"
    # The few-row kernel leaves activations unquantized: its reference is the weight-only product
    # (against the per-token reference it differs by the activations' e4m3 error: cosine 0.9949 on
    # an H100, 2026-12-06).
    def weight_only(self, x, out=None):
        return fp8_weight_only_reference(x, self.weight, self.weight_scale, self.bias)

    monkeypatch.setattr(Fp8Linear, "forward", weight_only)
    with torch.no_grad():
        b1 = cpu.compute_logits(cpu(ids[:, :1])).float()
    cos1 = torch.nn.functional.cosine_similarity(a1.flatten(), b1.flatten(), dim=0)
    assert cos1 > 0.999, f"one-row GPU FP8 logits drifted from the weight-only reference: cosine {cos1:.4f}"
