"""FP8 inputs quantized by their producers (RMSNorm, SiLU-and-mul) on the GPU: the same e4m3 bytes and
scales as the producer's own output quantized separately, and the same logits through the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from generation.layers.fp8 import Fp8Linear, dequantize_rows, fp8_layers, quantize_rows, scaled_mm_supported
from generation.layers.norm import RMSNorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not scaled_mm_supported(torch.device("cuda")),
        reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)",
    ),
]


@pytest.fixture(scope="module")
def kernels():
    from generation.layers import triton_fp8_fused, triton_fused

    return triton_fp8_fused, triton_fused


def _same(rows, x: torch.Tensor) -> None:
    """rows are x quantized per row, byte for byte, scale for scale. The reference runs on the CPU,
    where torch divides amax by 448 exactly, as the kernels do (div_rn); on CUDA torch multiplies by
    a rounded 1/448, and its scales can be an ulp away."""
    q, s = quantize_rows(x.cpu())
    assert torch.equal(rows.scale.cpu(), s)
    assert torch.equal(rows.q.cpu().view(torch.uint8), q.view(torch.uint8))


def _close(rows, reference: torch.Tensor) -> None:
    """rows dequantized are the torch op chain's output to within e4m3's rounding (a relative 2^-4)
    and the few bf16 ulps by which the Triton producer and torch's chain of ops may differ."""
    got = dequantize_rows(rows.q.cpu(), rows.scale.cpu())
    torch.testing.assert_close(got, reference.cpu().float(), rtol=0.07, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "h"), [(1, 4096), (17, 4096), (300, 4096), (5, 8192), (3, 200)])
def test_norm_then_quantize_in_one_kernel_gives_the_same_bytes(kernels, dtype, t, h):
    fused_quant, fused = kernels
    gen = torch.Generator().manual_seed(t * h)
    x = (torch.randn(t, h, generator=gen) * 3).to(dtype).cuda()
    residual = torch.randn(t, h, generator=gen).to(dtype).cuda()
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).cuda()
    # Without a residual: the fused norm's output, quantized by the separate kernel and by torch.
    rows, none = fused_quant.rms_norm_quant(x, weight, 1e-5)
    normed, _ = fused.rms_norm(x, weight, 1e-5)
    assert none is None and rows.dtype == dtype
    _same(rows, normed)
    norm = RMSNorm(h, 1e-5).to(dtype).cuda()
    norm.weight.data.copy_(weight)
    from generation.layers.kernel_choice import set_fused_kernels

    set_fused_kernels(False)
    try:
        reference = norm(x)  # the torch op chain
    finally:
        set_fused_kernels(True)
    _close(rows, reference)
    # With one: the sum written into the residual, as the fused norm writes it.
    res_a, res_b = residual.clone(), residual.clone()
    rows, summed = fused_quant.rms_norm_quant(x, weight, 1e-5, res_a)
    normed, _ = fused.rms_norm(x, weight, 1e-5, res_b)
    assert summed is res_a and torch.equal(res_a, res_b)
    _same(rows, normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "i"), [(1, 14336), (16, 14336), (300, 14336), (7, 28672), (2, 100)])
def test_silu_and_mul_then_quantize_in_one_kernel_gives_the_same_bytes(kernels, dtype, t, i):
    fused_quant, fused = kernels
    gen = torch.Generator().manual_seed(t + i)
    x = (torch.randn(t, 2 * i, generator=gen) * 4).to(dtype).cuda()
    rows = fused_quant.silu_and_mul_quant(x)
    assert rows.dtype == dtype and rows.shape == (t, i)
    _same(rows, fused.silu_and_mul(x))
    gate, up = x.chunk(2, dim=-1)
    _close(rows, F.silu(gate) * up)


def test_an_fp8_layer_takes_rows_quantized_elsewhere(kernels):
    fused_quant, _ = kernels
    layer = Fp8Linear(4096, 1024, bias=True, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(1024, 4096, generator=gen) * 0.02
    layer.weight.data.copy_(quantize_rows(w)[0].cuda())
    layer.weight_scale.data.copy_(quantize_rows(w)[1].cuda())
    layer.bias.data.normal_()
    x = torch.randn(40, 4096, generator=gen).to(torch.bfloat16).cuda()
    assert layer.takes_quantized_input(x) and not layer.takes_quantized_input(x.cpu())
    from generation.layers import triton_fp8
    from generation.layers.fp8 import Fp8Rows

    q, s = triton_fp8.quantize_rows(x)  # the quantization the layer runs on the GPU

    assert torch.equal(layer(Fp8Rows(q, s, x.dtype)), layer(x))  # the layer quantizes x to the same bytes


def test_the_engine_gives_the_same_logits_with_and_without_the_fused_quantization(tiny_model_factory):
    """Prefill of a 40-token prompt and a 16-sequence decode batch: FP8 inputs quantized inside the
    norms and SiLU-and-mul, or in launches of their own, are the same bytes, so the logits are equal."""
    from generation import LLM, SamplingParams
    from generation.layers.kernel_choice import set_fp8_producer_quantize

    from .test_host_kv_tier import prompt_logits

    path, _ = tiny_model_factory("default")
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(40)] for i in range(20)]
    outs = {}
    for fused in (True, False):
        set_fp8_producer_quantize(fused)
        try:
            llm = LLM(path, device="cuda", dtype=torch.bfloat16, quantization="fp8", block_size=16,
                      num_kv_blocks=256, enforce_eager=True)  # fmt: skip
            assert fp8_layers(llm.engine.model_runner.model)
            logits = prompt_logits(llm.engine, prompts[0], "a")
            tokens = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
            outs[fused] = (logits.cpu(), tokens)
            del llm
        finally:
            set_fp8_producer_quantize(True)
    assert torch.equal(outs[True][0], outs[False][0])
    assert outs[True][1] == outs[False][1]
