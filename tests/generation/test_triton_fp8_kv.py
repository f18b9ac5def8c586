"""Triton kernels over an FP8 (e4m3) KV cache against the torch reference (GPU): store, rotary + store,
paged prefill and decode attention, the re-rotated chunk copy; the engine with kv_cache_dtype="fp8" on CUDA."""

from __future__ import annotations

import math
import random

import pytest
import torch

from generation import LLM, SamplingParams
from generation.config import EngineConfig
from generation.engine.llm_engine import LLMEngine
from generation.layers import paged_attention as ref
from generation.layers.kernel_warmup import recording_triton_compiles
from generation.layers.kv_fp8 import FP8_KV_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8
from generation.layers.rerotation import copy_blocks_rerotated
from generation.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from tests.generation.test_paged_attention import make_paged_case

DEVICE = "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LLAMA_8B = (32, 8, 128)  # query heads, KV heads, head dim
SMOLLM2 = (9, 3, 64)
DTYPES = [torch.bfloat16, torch.float16]
TOL = 2e-2  # max error relative to the output's largest magnitude (as test_triton_attention)
K_SCALE, V_SCALE = 0.05, 0.02  # not 1: a kernel that forgets a scale is off by 20x or 50x


@pytest.fixture(scope="module")
def tri():
    from generation.layers import triton_attention

    return triton_attention


def _scales() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([K_SCALE], dtype=torch.float32, device=DEVICE),
            torch.tensor([V_SCALE], dtype=torch.float32, device=DEVICE))  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _index(t: torch.Tensor, *index) -> torch.Tensor:
    """t[index] for an FP8 tensor, gathered as bytes (advanced indexing has no float8 kernel everywhere)."""
    return _bytes(t)[index].view(FP8_KV_DTYPE)


def assert_close_rel(out: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"max error {err:.3g} vs output magnitude {scale:.3g}"


def assert_within_one_e4m3_step(
    cache: torch.Tensor, expected: torch.Tensor, scale: float, slack: float = 0.0, same: float = 0.99
) -> None:
    """Two FP8 caches whose values differ by at most one e4m3 step (a division rounded differently
    before the cast can move a value that sat on a rounding boundary), and mostly not at all.

    `slack` (absolute, dequantized units) allows for inputs that already differ before quantizing:
    bf16 rotations rounded in another order differ by a bf16 step of the terms, which a value near
    zero after cancellation cannot absorb in its own e4m3 step."""
    assert cache.dtype == FP8_KV_DTYPE and expected.dtype == FP8_KV_DTYPE
    a, b = dequantize_fp8(cache, scale), dequantize_fp8(expected, scale)
    step = torch.maximum(b.abs() * 2.0**-3, torch.full_like(b, 2.0**-9 * scale))
    assert bool(((a - b).abs() <= step * 1.001 + slack).all())
    assert (_bytes(cache) == _bytes(expected)).float().mean() > same


def _fp8_case(lens: list[int], heads: tuple[int, int, int], block_size: int, seed: int):
    _, num_kv_heads, head_dim = heads
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, dtype=torch.float32, device=DEVICE, seed=seed)
    return case, quantize_fp8(case.k_cache, K_SCALE), quantize_fp8(case.v_cache, V_SCALE)


def _queries(n: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


# --------------------------------------------------------------------------------------------------
# Stores
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_quantizes_like_the_reference(tri, dtype):
    num_kv_heads, head_dim, num_heads = 8, 128, 32
    shape = (40, 16, num_kv_heads, head_dim)
    kc = torch.zeros(shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    vc = torch.zeros(shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qkv = torch.randn(100, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE) * 4
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(100, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(100, num_kv_heads, head_dim)
    k[1, 0, :8] = -1e4  # far past 448 * scale: saturates
    slots = torch.randperm(40 * 16, device=DEVICE)[:100]
    slots[::7] = -1
    free = next(s for s in range(40 * 16) if s not in set(slots.tolist()))
    slots[1] = free
    k_scale, v_scale = _scales()
    tri.store_kvcache(k, v, kc, vc, slots, k_scale, v_scale)
    ref.store_kvcache_torch(k, v, kc_ref, vc_ref, slots, k_scale, v_scale)
    assert_within_one_e4m3_step(kc, kc_ref, K_SCALE)
    assert_within_one_e4m3_step(vc, vc_ref, V_SCALE)
    rows = kc.view(-1, num_kv_heads, head_dim)
    assert torch.isfinite(kc.float()).all() and rows[free, 0, :8].float().max() == -FP8_MAX
    # A stored value is the one the scale divides: q * k_scale is back near k (the saturated row aside).
    keep = (slots >= 0).nonzero()[1:, 0]
    got = dequantize_fp8(_index(rows, slots[keep]), K_SCALE)
    torch.testing.assert_close(got, k[keep].float(), rtol=2.0**-3, atol=2.0**-9 * K_SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64)])
def test_rotary_store_quantizes_the_rotated_k_and_v(dtype, heads, kv_heads, head_dim):
    from generation.layers import triton_fused as fused

    tokens, num_blocks, block_size = 23, 12, 16
    rotary = RotaryEmbedding(head_dim, 500000.0, {"rope_type": "default"}, max_positions=8192).to(DEVICE)
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype).to(DEVICE)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 7, 4095, 8191] + list(range(100, 118)), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(6))[:tokens].to(DEVICE)
    slots[::5] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    k_scale, v_scale = _scales()
    q_rot = fused.rotary_store_kvcache(q, k, v, positions, rotary.cos_sin_table(dtype), k_cache, v_cache, slots,
                                       k_scale, v_scale)  # fmt: skip
    q_ref, k_ref = apply_rotary(q, k, *rotary(positions, dtype))
    ref.store_kvcache_torch(k_ref, v, kc_ref, vc_ref, slots, k_scale, v_scale)
    assert_close_rel(q_rot, q_ref, tol=1e-2)
    # In bf16 the fused kernel and torch round the rotation's terms in a different order.
    slack, same = (2.0**-7 * float(k.float().abs().amax()), 0.95) if dtype == torch.bfloat16 else (0.0, 0.99)
    assert_within_one_e4m3_step(k_cache, kc_ref, K_SCALE, slack=slack, same=same)
    assert_within_one_e4m3_step(v_cache, vc_ref, V_SCALE)


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def _check_decode(tri, lens, heads, block_size, dtype, seed=0):
    num_heads, _, head_dim = heads
    case, k8, v8 = _fp8_case(lens, heads, block_size, seed)
    q = _queries(len(lens), num_heads, head_dim, dtype, seed + 1)
    k_scale, v_scale = _scales()
    args = (q, k8, v8, case.context_lens, case.block_tables, 1 / math.sqrt(head_dim))
    out = tri.paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert_close_rel(out, ref.paged_decode_attention_torch(*args, k_scale, v_scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [LLAMA_8B, SMOLLM2])
def test_decode_over_fp8_mixed_lengths(tri, heads, dtype):
    _check_decode(tri, [1, 15, 16, 17, 1000, 4096], heads, 16, dtype)


@pytest.mark.parametrize("ctx", [17, 4096, 32768])
def test_decode_over_fp8_split_k(tri, ctx):
    # Batch 1 over a long context splits the keys: the V scale must reach every partial.
    assert ctx < 4096 or tri.decode_num_splits(1, 8, ctx, torch.device(DEVICE))[0] > 1
    _check_decode(tri, [ctx], LLAMA_8B, 16, torch.bfloat16, seed=ctx)


def test_decode_over_fp8_fp32_queries(tri):
    _check_decode(tri, [1, 33, 300], (8, 2, 64), 16, torch.float32, seed=5)


def _check_prefill(tri, lens, new, heads, block_size, dtype, seed=0):
    num_heads, _, head_dim = heads
    case, k8, v8 = _fp8_case(lens, heads, block_size, seed)
    q = _queries(sum(new), num_heads, head_dim, dtype, seed + 1)
    k_scale, v_scale = _scales()
    args = (q, k8, v8, _cu(new), case.context_lens, case.block_tables, 1 / math.sqrt(head_dim))
    out = tri.paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert_close_rel(out, ref.paged_prefill_attention_torch(*args, k_scale, v_scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [LLAMA_8B, SMOLLM2])
def test_prefill_over_fp8_with_cached_prefix(tri, heads, dtype):
    lens, new = [4096, 17, 1000, 16, 300, 64], [100, 17, 1, 5, 299, 64]
    _check_prefill(tri, lens, new, heads, 16, dtype, seed=10)


def test_prefill_over_fp8_split_keys(tri):
    lens, new = [4096, 300], [96, 1]
    assert tri.prefill_num_splits(sum(new), (sum(new) // 32 + 2) * 8, 4096, torch.device(DEVICE))[0] > 1
    _check_prefill(tri, lens, new, LLAMA_8B, 16, torch.bfloat16, seed=15)
    _check_prefill(tri, lens, new, SMOLLM2, 16, torch.bfloat16, seed=16)


def test_prefill_over_fp8_fp32_queries(tri):
    _check_prefill(tri, [70, 200], [70, 50], (4, 4, 64), 16, torch.float32, seed=12)


def test_fp8_decode_follows_new_scales_inside_a_cuda_graph(tri):
    # The scales are read by pointer: a graph captured with one value replays with another.
    case, k8, v8 = _fp8_case([300, 40], LLAMA_8B, 16, seed=8)
    q = _queries(2, 32, 128, torch.bfloat16, 9)
    k_scale, v_scale = _scales()
    args = (q, k8, v8, case.context_lens, case.block_tables, 1 / math.sqrt(128))
    tri.paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    k_scale.fill_(0.1)
    v_scale.fill_(0.5)
    graph.replay()
    assert_close_rel(out, ref.paged_decode_attention_torch(*args, k_scale, v_scale))


# --------------------------------------------------------------------------------------------------
# Re-rotated chunk copy
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 16, 8, 128), (2, 4, 3, 16)])
def test_fp8_triton_copy_equals_the_torch_path(shape):
    from generation.layers.triton_kv_copy import copy_rerotate_blocks

    layers, block_size, kv_heads, head_dim = shape
    num_blocks = 64
    inv_freq = rope_inv_freq(head_dim, 500000.0, {"rope_type": "default"}).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    k_scales = torch.tensor([0.02, 0.07, 0.5][:layers], device=DEVICE)
    scales = torch.stack([k_scales, torch.full_like(k_scales, 0.04)], dim=1)  # [layers, K/V], as kv_scales
    values = (torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, generator=gen) * 3).to(DEVICE)
    before = quantize_fp8(values, scales.view(layers, 2, 1, 1, 1, 1))
    copies = [(b, 32 + b, delta) for b, delta in enumerate([-37, 0, 16, 2_900] * 5)]
    expected, out = before.clone(), before.clone()
    copy_blocks_rerotated(expected, copies, inv_freq, scales[:, 0])
    copy_rerotate_blocks(out, copies, inv_freq, scales[:, 0])  # a strided column, as the runner passes
    torch.cuda.synchronize()
    dst = [d for _, d, _ in copies]
    assert torch.equal(_bytes(out[:, 1]), _bytes(expected[:, 1]))  # values: bytes, everywhere
    untouched = [b for b in range(num_blocks) if b not in dst]
    assert torch.equal(_bytes(out)[:, 0, untouched], _bytes(before)[:, 0, untouched])
    for layer in range(layers):
        assert_within_one_e4m3_step(_index(out, layer, 0, dst), _index(expected, layer, 0, dst),
                                    float(k_scales[layer]))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------


def test_the_fp8_engine_on_cuda_matches_the_fp8_engine_on_cpu(tiny_model_factory):
    # CUDA graphs, the fused rotary store and the Triton attention against the torch reference,
    # both over an FP8 cache (fp32 model, so the kernels' own rounding is small).
    path = tiny_model_factory("default")[0]
    args = dict(dtype=torch.float32, block_size=16, num_kv_blocks=64, kv_cache_dtype="fp8")
    gpu, cpu = LLM(path, device="cuda", **args), LLM(path, device="cpu", **args)
    assert gpu.engine.model_runner.decode_graphs is not None
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 120) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    got = [o.token_ids for o in gpu.generate(prompts, params)]
    want = [o.token_ids for o in cpu.generate(prompts, params)]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 4  # a near-tie may flip a late token


def test_the_fp8_engine_compiles_no_kernel_while_serving(tiny_model_factory):
    path = tiny_model_factory("default")[0]
    engine = LLMEngine(path, EngineConfig(device="cuda", dtype="bfloat16", max_model_len=256, block_size=16,
                                          max_num_seqs=32, kv_cache_dtype="fp8"))  # fmt: skip
    assert engine.model_runner.kv_cache.dtype == FP8_KV_DTYPE
    with recording_triton_compiles() as compiled:
        rng = random.Random(0)
        for _ in range(3):
            for _ in range(rng.randrange(1, 30)):
                prompt = [rng.randrange(3, 120) for _ in range(rng.randrange(1, 200))]
                engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
    assert compiled == []
