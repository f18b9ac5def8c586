"""Triton paged-attention kernels against the torch reference (GPU; `python THIS --bench` times them)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from generation.layers import paged_attention as ref
from tests.generation.test_paged_attention import make_paged_case

# Also runs on CPU under Triton's interpreter (TRITON_INTERPRET=1), slowly: keep to small shapes there. Triton
# 3.6's interpreter needs one local fix for that: its tensor __index__ must use int(self.handle.data.item()).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET, reason="needs a CUDA GPU"),
]

LLAMA_8B = (32, 8, 128)  # query heads, KV heads, head dim
SMOLLM2 = (9, 3, 64)
# Triton 3.6's interpreter gets bf16 tl.dot wrong (fp16 and fp32 are right), so it checks fp16 only.
HALF = torch.float16 if INTERPRET else torch.bfloat16
DTYPES = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]
TOL = 2e-2  # max error relative to the output's largest magnitude


@pytest.fixture(scope="module")
def tri():
    from generation.layers import triton_attention

    return triton_attention


def assert_close_rel(out: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"max error {err:.3g} vs output magnitude {scale:.3g}"


def _queries(n: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


# --------------------------------------------------------------------------------------------------
# store_kvcache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_matches_reference_with_padding_and_strided_rows(tri, dtype):
    num_kv_heads, head_dim, num_heads = 8, 128, 32
    shape = (40, 16, num_kv_heads, head_dim)
    kc, vc = torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    # k, v as slices of a fused qkv projection: rows strided, each row dense.
    qkv = torch.randn(100, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(100, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(100, num_kv_heads, head_dim)
    slots = torch.randperm(40 * 16, device=DEVICE)[:100]
    slots[::7] = -1
    tri.store_kvcache(k, v, kc, vc, slots)
    ref.store_kvcache_torch(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


# --------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------


def _check_decode(tri, lens, heads, block_size, dtype, seed=0):
    num_heads, num_kv_heads, head_dim = heads
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE, seed=seed)
    q = _queries(len(lens), num_heads, head_dim, dtype, seed + 1)
    scale = 1 / math.sqrt(head_dim)
    args = (q, case.k_cache, case.v_cache, case.context_lens, case.block_tables, scale)
    assert_close_rel(tri.paged_decode_attention(*args), ref.paged_decode_attention_torch(*args))


DECODE_LENS = [1, 15, 16, 17, 1000, 4096] if not INTERPRET else [1, 15, 16, 17, 130]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [LLAMA_8B, SMOLLM2])
def test_decode_mixed_lengths(tri, heads, dtype):
    _check_decode(tri, DECODE_LENS, heads, 16, dtype)


@pytest.mark.parametrize("heads", [LLAMA_8B, SMOLLM2])
def test_decode_block_size_32(tri, heads):
    _check_decode(tri, DECODE_LENS, heads, 32, HALF, seed=2)


@pytest.mark.parametrize("ctx", [1, 17, 512, 4096, 32768] if not INTERPRET else [1, 17, 300])
def test_decode_batch_one_long_context_split_k(tri, ctx):
    # Batch 1 is where the context is split across programs; 32k is the longest context supported.
    _check_decode(tri, [ctx], LLAMA_8B, 16, HALF, seed=ctx)


def test_decode_large_batch_without_split(tri):
    lens = torch.randint(1, 600 if not INTERPRET else 60, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    assert tri.decode_num_splits(128, 8, 600, torch.device(DEVICE))[0] == 1
    _check_decode(tri, lens, LLAMA_8B, 16, HALF, seed=4)


def test_decode_fp32_is_exact_enough(tri):
    _check_decode(tri, [1, 33, 300], (8, 2, 64), 16, torch.float32, seed=5)


def test_decode_zero_length_padding_rows_are_finite(tri):
    # CUDA-graph batches are padded with context length 0 rows; they must not produce NaN.
    case = make_paged_case([20, 5], 2, 64, 16, dtype=HALF, device=DEVICE, seed=6)
    lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    q = _queries(2, 8, 64, HALF, 7)
    out = tri.paged_decode_attention(q, case.k_cache, case.v_cache, lens, case.block_tables, 0.125)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_decode_captures_in_a_cuda_graph(tri):
    case = make_paged_case([3000, 100], 8, 128, 16, dtype=HALF, device=DEVICE, seed=8)
    q = _queries(2, 32, 128, HALF, 9)
    case.context_lens.copy_(torch.tensor([100, 50], dtype=torch.int32))
    args = (q, case.k_cache, case.v_cache, case.context_lens, case.block_tables, 1 / math.sqrt(128))
    tri.paged_decode_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.paged_decode_attention(*args)
    # Longer and shorter contexts in the same buffers: the graph must follow them.
    case.context_lens.copy_(torch.tensor([3000, 17], dtype=torch.int32))
    graph.replay()
    assert_close_rel(out, ref.paged_decode_attention_torch(*args))


# --------------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------------


def _check_prefill(tri, lens, new, heads, block_size, dtype, seed=0):
    num_heads, num_kv_heads, head_dim = heads
    case = make_paged_case(lens, num_kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE, seed=seed)
    q = _queries(sum(new), num_heads, head_dim, dtype, seed + 1)
    scale = 1 / math.sqrt(head_dim)
    args = (q, case.k_cache, case.v_cache, _cu(new), case.context_lens, case.block_tables, scale)
    assert_close_rel(tri.paged_prefill_attention(*args), ref.paged_prefill_attention_torch(*args))


PREFILL_LENS = [1, 15, 16, 17, 1000, 4096] if not INTERPRET else [1, 15, 16, 17, 150]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [LLAMA_8B, SMOLLM2])
def test_prefill_packed_without_prefix(tri, heads, dtype):
    _check_prefill(tri, PREFILL_LENS, PREFILL_LENS, heads, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [LLAMA_8B, SMOLLM2])
def test_prefill_packed_with_cached_prefix(tri, heads, dtype):
    lens = [4096, 17, 1000, 16, 300, 64] if not INTERPRET else [150, 17, 100, 16]
    new = [100, 17, 1, 5, 299, 64] if not INTERPRET else [40, 17, 1, 5]  # some fully new, some one token
    _check_prefill(tri, lens, new, heads, 16, dtype, seed=10)


@pytest.mark.parametrize("heads", [LLAMA_8B, SMOLLM2])
def test_prefill_block_size_32(tri, heads):
    lens, new = ([1000, 33, 31], [500, 33, 2]) if not INTERPRET else ([100, 33, 31], [60, 33, 2])
    _check_prefill(tri, lens, new, heads, 32, HALF, seed=11)


def test_prefill_of_a_short_chunk_over_a_long_prefix_splits_the_keys(tri):
    # The prefix-cache case: a question of ~100 tokens after 4,000 cached ones. Few (tile, head)
    # programs would each walk the whole context, so the keys are split over programs.
    lens, new = ([4096, 300], [96, 1]) if not INTERPRET else ([400, 130], [40, 1])
    block_tables_width = -(-max(lens) // 16)
    assert tri.prefill_num_splits(sum(new), (sum(new) // 32 + 2) * 8, block_tables_width * 16,
                                  torch.device(DEVICE))[0] > 1  # fmt: skip
    _check_prefill(tri, lens, new, LLAMA_8B, 16, HALF, seed=15)
    _check_prefill(tri, lens, new, SMOLLM2, 16, HALF, seed=16)


def test_prefill_fp32_and_mha(tri):
    _check_prefill(tri, [70, 200], [70, 50], (4, 4, 64), 16, torch.float32, seed=12)


def test_prefill_matches_decode_for_single_tokens(tri):
    lens = [5, 900, 33] if not INTERPRET else [5, 90, 33]
    case = make_paged_case(lens, 8, 128, 16, dtype=HALF, device=DEVICE, seed=13)
    q = _queries(3, 32, 128, HALF, 14)
    tables, lens_t = case.block_tables, case.context_lens
    prefill = tri.paged_prefill_attention(q, case.k_cache, case.v_cache, _cu([1, 1, 1]), lens_t, tables, 0.09)
    decode = tri.paged_decode_attention(q, case.k_cache, case.v_cache, lens_t, tables, 0.09)
    assert_close_rel(prefill, decode, tol=1e-2)


@pytest.mark.skipif(INTERPRET, reason="dispatch picks Triton on CUDA only")
def test_dispatch_picks_triton_on_cuda():
    assert ref.attention_backend("cuda") == "triton"


# --------------------------------------------------------------------------------------------------
# Timing (not a test): python tests/generation/test_triton_attention.py --bench
# --------------------------------------------------------------------------------------------------


def bench() -> None:
    """Print kernel times against the torch reference and SDPA on contiguous K/V."""
    from functools import partial

    import torch.nn.functional as F
    from triton.testing import do_bench, do_bench_cudagraph

    from generation.layers import triton_attention as tri

    def us(fn) -> float:
        return do_bench(fn, warmup=25, rep=200) * 1e3

    def both(fn) -> str:
        return f"{us(fn):8.1f} us eager, {do_bench_cudagraph(fn, rep=200) * 1e3:7.1f} us in a CUDA graph"

    num_heads, num_kv_heads, head_dim = LLAMA_8B
    scale = 1 / math.sqrt(head_dim)
    sdpa = F.scaled_dot_product_attention
    print("decode, Llama-8B heads (32 q / 8 kv / 128), bf16, block 16")
    for batch, ctx in [(1, 512), (1, 4096), (1, 32768), (32, 4096), (128, 1024)]:
        case = make_paged_case([ctx] * batch, num_kv_heads, head_dim, 16, torch.bfloat16, DEVICE, spare_columns=0)
        q = _queries(batch, num_heads, head_dim, torch.bfloat16, 0)
        args = (q, case.k_cache, case.v_cache, case.context_lens, case.block_tables, scale)
        kd = torch.stack(case.keys).transpose(1, 2).contiguous()  # [B, Hkv, T, D]
        vd = torch.stack(case.values).transpose(1, 2).contiguous()
        splits = tri.decode_num_splits(batch, num_kv_heads, ctx, q.device)[0]
        graph_s = do_bench_cudagraph(partial(tri.paged_decode_attention, *args), rep=200) / 1e3
        kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim * 2
        print(f"  B={batch:<4} ctx={ctx:<6} splits={splits:<3} K+V read at {kv_bytes / graph_s / 1e9:6.0f} GB/s")
        print(f"    triton      {both(partial(tri.paged_decode_attention, *args))}")
        print(f"    torch ref   {both(partial(ref.paged_decode_attention_torch, *args))}")
        print(f"    sdpa dense  {both(partial(sdpa, q[:, :, None], kd, vd, enable_gqa=True))}")

    print("prefill, Llama-8B heads, bf16, block 16, one sequence")
    for ctx, new in [(512, 512), (4096, 4096), (4096, 512)]:
        case = make_paged_case([ctx], num_kv_heads, head_dim, 16, torch.bfloat16, DEVICE, spare_columns=0)
        q = _queries(new, num_heads, head_dim, torch.bfloat16, 0)
        args = (q, case.k_cache, case.v_cache, _cu([new]), case.context_lens, case.block_tables, scale)
        qd = q.transpose(0, 1)[None]  # [1, Hq, new, D]
        kd = case.keys[0].transpose(0, 1)[None].contiguous()
        vd = case.values[0].transpose(0, 1)[None].contiguous()
        mask = torch.ones(new, ctx, dtype=torch.bool, device=DEVICE).tril(ctx - new)
        t = us(partial(tri.paged_prefill_attention, *args))
        flops = 4 * num_heads * head_dim * (new * ctx - new * (new - 1) / 2)
        print(f"  ctx={ctx:<5} new={new:<5} triton {t:8.1f} us ({flops / t / 1e6:5.0f} TFLOP/s)")
        print(f"    torch ref  {us(partial(ref.paged_prefill_attention_torch, *args)):8.1f} us")
        causal = dict(is_causal=True) if new == ctx else dict(attn_mask=mask)
        print(f"    sdpa dense {us(partial(sdpa, qd, kd, vd, enable_gqa=True, **causal)):8.1f} us")

    print("store_kvcache (8 kv heads x 128, bf16): triton kernel vs the reference (-1 filter + index_copy_)")
    kc = torch.zeros(4096, 16, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    vc = torch.zeros_like(kc)
    flat = kc.view(-1, num_kv_heads, head_dim)
    for n in [1, 64, 4096]:
        k = torch.randn(n, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
        slots = torch.randperm(kc.shape[0] * 16, device=DEVICE)[:n]
        a = us(partial(tri.store_kvcache, k, k, kc, vc, slots))
        b = us(partial(ref.store_kvcache_torch, k, k, kc, vc, slots))
        c = us(partial(flat.index_copy_, 0, slots, k))
        print(f"  tokens={n:<5} triton {a:6.1f} us, reference {b:6.1f} us, one bare index_copy_ (k only) {c:6.1f} us")


if __name__ == "__main__":
    if "--bench" in sys.argv:
        bench()
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", "-p", "no:cacheprovider"]))
