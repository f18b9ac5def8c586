"""Fused Triton kernels (norms, rotary + KV store, SiLU-and-mul, skinny matmul, decode advance) against torch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from generation.engine.decode_inputs import DecodeInputs
from generation.layers import paged_attention as ref
from generation.layers.attention import AttentionMetadata, KVCache, paged_attention
from generation.layers.rotary import RopeInputs, RotaryEmbedding, apply_rotary
from tests.generation.test_paged_attention import make_paged_case

# Like test_triton_attention: also runs on CPU under Triton's interpreter (TRITON_INTERPRET=1).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET, reason="needs a CUDA GPU"),
]

# The interpreter gets bf16 wrong (tl.dot, and it truncates where the GPU rounds to nearest even).
HALF = torch.float16 if INTERPRET else torch.bfloat16
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def fused():
    from generation.layers import triton_fused

    return triton_fused


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _assert_within_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to a rounding step of the dtype (fp32 sums are ordered differently)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape and torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4096, 576, 64])
def test_rms_norm_with_and_without_residual_matches_torch(fused, dtype, width):
    x = _randn(7, width, dtype=dtype, seed=0)
    residual = _randn(7, width, dtype=dtype, seed=1, scale=3.0)
    w = _randn(width, dtype=dtype, seed=2)
    out, none = fused.rms_norm(x, w, 1e-5)
    assert none is None
    _assert_within_rounding(out, _rms_norm_torch(x, w, 1e-5))
    expected_sum = x + residual
    out, res = fused.rms_norm(x, w, 1e-6, residual)
    assert res is residual and torch.equal(residual, expected_sum)  # the sum is written in place
    _assert_within_rounding(out, _rms_norm_torch(expected_sum, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(fused, dtype):
    x = _randn(5, 2 * 1536 + 0, dtype=dtype, seed=3, scale=4.0)
    gate, up = x.chunk(2, dim=-1)
    _assert_within_rounding(fused.silu_and_mul(x), F.silu(gate) * up)
    odd = _randn(3, 2 * 1100, dtype=dtype, seed=4)  # not a multiple of the column block
    _assert_within_rounding(fused.silu_and_mul(odd), F.silu(odd[:, :1100]) * odd[:, 1100:])


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64)])
def test_rotary_store_matches_rotary_then_store(fused, dtype, heads, kv_heads, head_dim):
    tokens, num_blocks, block_size = 23, 12, 16
    rotary = RotaryEmbedding(head_dim, 500000.0, {"rope_type": "default"}, max_positions=8192).to(DEVICE)
    # q, k, v as slices of one fused projection: strided rows, dense heads.
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 7, 4095, 8191] + list(range(100, 118)), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(6))[:tokens].to(DEVICE)
    slots[::5] = -1  # padding rows store nothing
    cache = _randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=7)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    q_rot = fused.rotary_store_kvcache(q, k, v, positions, rotary.cos_sin_table(dtype), k_cache, v_cache, slots)
    q_ref, k_ref = apply_rotary(q, k, *rotary(positions, dtype))
    kc_ref, vc_ref = cache[0].clone(), cache[1].clone()
    ref.store_kvcache_torch(k_ref, v, kc_ref, vc_ref, slots)
    _assert_within_rounding(q_rot, q_ref)
    _assert_within_rounding(k_cache, kc_ref)
    assert torch.equal(v_cache, vc_ref)


@pytest.mark.parametrize("num_decodes", [0, 3])
def test_paged_attention_with_decodes_before_chunks_matches_one_prefill_kernel(num_decodes):
    # Decodes riding along with prompt chunks go through the decode kernel: same result as
    # letting the prefill kernel serve every sequence.
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    lens, new = [40, 300, 17, 120, 33], [1, 1, 1, 60, 33]
    case = make_paged_case(lens, kv_heads, head_dim, block_size, dtype=HALF, device=DEVICE, seed=8)
    total = sum(new)
    q = _randn(total, heads, head_dim, dtype=HALF, seed=9)
    k = _randn(total, kv_heads, head_dim, dtype=HALF, seed=10)
    v = _randn(total, kv_heads, head_dim, dtype=HALF, seed=11)
    positions = torch.tensor([p for n, c in zip(new, lens, strict=True) for p in range(c - n, c)], device=DEVICE)
    slots = torch.cat([case.slots[i][lens[i] - n :] for i, n in enumerate(new)]).to(DEVICE)
    rotary = RotaryEmbedding(head_dim, 10000.0, {"rope_type": "default"}, max_positions=512).to(DEVICE)
    rope = RopeInputs(positions, tables=rotary(positions, HALF))
    cu = torch.tensor([0, *torch.tensor(new[num_decodes:]).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_all = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    outs = []
    for nd, cu_q in ((num_decodes, cu), (0, cu_all)):
        meta = AttentionMetadata(True, slots, case.context_lens, case.block_tables, cu_q, num_decodes=nd)
        outs.append(paged_attention(q, k, v, rope, KVCache(case.k_cache.clone(), case.v_cache.clone()), meta, 0.125))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_linear(rows, bias):
    from generation.layers import triton_skinny_gemm

    n, k = (200, 512) if INTERPRET else (6144, 4096)
    x = _randn(rows, k, dtype=HALF, seed=12)
    w = _randn(n, k, dtype=HALF, seed=13, scale=0.05)
    b = _randn(n, dtype=HALF, seed=14) if bias else None
    expected = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    for config in triton_skinny_gemm.CANDIDATES:
        out = triton_skinny_gemm.skinny_gemm(x, w, b, config)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    target = torch.full((rows, n), float("nan"), dtype=HALF, device=DEVICE)
    triton_skinny_gemm.skinny_gemm(x, w, b, triton_skinny_gemm.CANDIDATES[0], out=target)
    torch.testing.assert_close(target.float(), expected, atol=2e-2, rtol=2e-2)


def test_skinny_gemm_handles_a_k_that_is_not_a_multiple_of_the_block():
    from generation.layers import triton_skinny_gemm

    x = _randn(3, 200, dtype=HALF, seed=15)
    w = _randn(48, 200, dtype=HALF, seed=16)
    out = triton_skinny_gemm.skinny_gemm(x, w, None, triton_skinny_gemm.SkinnyConfig(16, 128, 2))
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=5e-2, rtol=2e-2)


@pytest.mark.skipif(INTERPRET, reason="times kernels in CUDA graphs")
def test_choose_times_every_shape_and_the_chosen_kernels_compute_the_same():
    from generation.layers import triton_skinny_gemm
    from generation.layers.linear import Linear

    torch.manual_seed(31)
    up = [Linear(512, 1536, bias=False).to(DEVICE, HALF) for _ in range(4)]
    down = [Linear(768, 512, bias=True).to(DEVICE, HALF) for _ in range(4)]
    triton_skinny_gemm.choose([m.weight for m in up + down])
    assert (1536, 512, HALF) in triton_skinny_gemm._choices and (512, 768, HALF) in triton_skinny_gemm._choices
    for rows in (1, 7, 16, 40):  # 40 rows: beyond the skinny kernel, always cuBLAS
        for layer in (up[0], down[0]):
            x = _randn(rows, layer.in_features, dtype=HALF, seed=32)
            expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
            torch.testing.assert_close(layer(x).float(), expected, atol=3e-2, rtol=2e-2)


def test_advance_kernel_matches_the_cpu_rule():
    # Rows of a padded 8-row layout: a plain step, a block boundary, a row whose lookahead ended
    # (no block next), and one at the table's width.
    from generation.engine.triton_advance import advance_decode_rows

    block_size, bs, n = 4, 8, 4
    host = DecodeInputs(bs, 6, block_size, torch.device("cpu"))
    layout = host.host[: (4 + 6) * bs].view(4 + 6, bs)
    layout[0, :n] = torch.tensor([11, 12, 13, 14])
    layout[1, :n] = torch.tensor([5, 7, 7, 11])  # positions
    layout[2, :n] = torch.tensor([21, 23, 31, 47])
    layout[3, :n] = layout[1, :n] + 1
    layout[2, n:] = -1
    layout[4:, :] = -1
    layout[4:6, 0] = torch.tensor([3, 5])
    layout[4:7, 1] = torch.tensor([2, 9, 6])
    layout[4:6, 2] = torch.tensor([8, 7])  # no third block: position 8 has nowhere to go
    layout[4:7, 3] = torch.tensor([1, 4, 11])  # width 3: position 12 is past it
    host.bs, host.num_rows, host.width = bs, n, 3
    device_buffer = host.host.clone().to(DEVICE)
    tokens = torch.tensor([101, 102, 103, 104], dtype=torch.int64)
    host.advance(tokens)
    advance_decode_rows(device_buffer, tokens.to(DEVICE), n, bs, 3, block_size)
    assert torch.equal(device_buffer.cpu(), host.host)
    assert layout[1, :n].tolist() == [6, 8, 7, 11] and layout[2, :n].tolist() == [22, 24, -1, -1]
    assert layout[3, :n].tolist() == [7, 9, 8, 12] and layout[0, :n].tolist() == [101, 102, 103, 104]
    assert layout[2, n:].tolist() == [-1] * (bs - n)
