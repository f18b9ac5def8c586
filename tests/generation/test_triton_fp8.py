"""FP8 weight kernels on the GPU (per-token quantization, few-row matmul, _scaled_mm) against the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from generation.layers.fp8 import Fp8Linear, fp8_linear_reference, quantize_rows, scaled_mm_supported

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


def _assert_close_to_reference(out: torch.Tensor, x, qw, sw, bias=None) -> None:
    ref = fp8_linear_reference(x.cpu().float(), qw.cpu(), sw.cpu(), None if bias is None else bias.cpu().float())
    # The same e4m3 operands on both sides: only the fp32 sum order and the bf16 output rounding differ.
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=2e-2, rtol=1.6e-2)


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
    for config in kernels.CANDIDATES:
        try:
            out = kernels.fp8_skinny_gemm(x, qw, sw, bias, config)
        except Exception as exc:  # noqa: BLE001 - choose() skips configs the compiler rejects; say which
            pytest.skip(f"not applicable: config {config} does not compile here ({type(exc).__name__})")
        _assert_close_to_reference(out, x, qw, sw, bias)


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
    _assert_close_to_reference(kernels.fp8_linear(x, qw, sw, None), x, qw, sw)


def test_fp8_engine_on_the_gpu_answers_like_the_cpu_reference(tiny_model_factory):
    from generation import LLM, SamplingParams

    path, _ = tiny_model_factory("default")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 42, 9, 77, 3, 64, 12], [100, 101, 7, 7, 7, 55]]
    gpu = LLM(path, device="cuda", dtype=torch.float16, quantization="fp8", num_kv_blocks=64)
    assert isinstance(gpu.model.model.layers[0].mlp.down_proj, Fp8Linear)
    cpu = LLM(path, device="cpu", dtype=torch.float32, quantization="fp8", num_kv_blocks=64)
    a = [r.token_ids for r in gpu.generate(prompts, params)]
    b = [r.token_ids for r in cpu.generate(prompts, params)]
    agree = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    assert agree >= 0.75 * sum(len(r) for r in a), (a, b)
