"""FP8 (e4m3) KV cache pieces on CPU: quantization, the torch attention reference, re-rotated copies, sizing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from generation.config import EngineConfig, ModelConfig
from generation.engine.kv_cache_dtype import kv_cache_scales, resolve_kv_cache_dtype
from generation.engine.kv_cache_sizing import block_bytes, decide_num_blocks
from generation.layers.attention import KVCache, layer_kv_caches
from generation.layers.kv_fp8 import FP8_KV_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8
from generation.layers.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    store_kvcache,
    store_kvcache_torch,
)
from generation.layers.rerotation import copy_blocks_rerotated, rerotate_keys
from generation.layers.rotary import rope_inv_freq
from rag.errors import ModelError
from tests.generation.test_paged_attention import dense_causal_attention, full_queries, make_paged_case

# e4m3: 3 mantissa bits, so rounding to nearest errs by at most 2^-4 of a normal value; below the
# smallest normal (2^-6) the step is the subnormal spacing 2^-9, half of it 2^-10.
HALF_STEP_REL = 2.0**-4
HALF_SUBNORMAL = 2.0**-10
K_SCALE, V_SCALE = 0.05, 0.02  # not 1: a path that forgets a scale is off by 20x or 50x


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _scale(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_a_round_trip_errs_by_at_most_half_an_e4m3_step(scale):
    gen = torch.Generator().manual_seed(0)
    # Magnitudes from subnormal to the top of the range (448 / scale), both signs.
    sign = torch.randint(0, 2, (4096,), generator=gen) * 2 - 1
    x = sign * torch.logspace(-4, math.log10(FP8_MAX), 4096) * (1 + torch.rand(4096, generator=gen) * 1e-3) * scale
    x = x.clamp(-FP8_MAX * scale, FP8_MAX * scale)
    back = dequantize_fp8(quantize_fp8(x, scale), scale)
    assert back.dtype == torch.float32
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * HALF_STEP_REL, torch.full_like(x, HALF_SUBNORMAL * scale)) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max():.3g}"
    assert err.max() > 0  # it is a quantization: most values move


def test_every_e4m3_value_comes_back_as_the_same_bytes():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7f and 0xff are NaN in e4m3fn
    q = codes.view(FP8_KV_DTYPE)
    for scale in (1.0, 0.37, 12.5):
        assert torch.equal(_bytes(quantize_fp8(dequantize_fp8(q, scale), scale)), codes)


def test_out_of_range_values_saturate_and_never_become_nan_or_inf():
    scale = 0.5
    x = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), FP8_MAX * scale * 1.04, -FP8_MAX * scale * 1.5, 3e38])
    q = quantize_fp8(x, scale)
    back = dequantize_fp8(q, scale)
    assert torch.isfinite(back).all()
    assert back.tolist() == [FP8_MAX * scale * s for s in (1, -1, 1, -1, 1, -1, 1)]


def test_resolve_kv_cache_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="auto, fp8"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


def test_kv_scales_come_from_the_model_else_one():
    model = torch.nn.Module()
    ones = kv_cache_scales(model, 3, FP8_KV_DTYPE, torch.device("cpu"))
    assert ones is not None and ones.dtype == torch.float32 and torch.equal(ones, torch.ones(3, 2))
    assert kv_cache_scales(model, 3, torch.bfloat16, torch.device("cpu")) is None  # no scales unless FP8
    given = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], dtype=torch.bfloat16)
    model.kv_cache_scales = given
    scales = kv_cache_scales(model, 3, FP8_KV_DTYPE, torch.device("cpu"))
    assert scales is not None and scales.dtype == torch.float32 and torch.equal(scales, given.float())
    model.kv_cache_scales = torch.ones(2, 2)
    with pytest.raises(ModelError, match=r"not \[3, 2\]"):
        kv_cache_scales(model, 3, FP8_KV_DTYPE, torch.device("cpu"))
    model.kv_cache_scales = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ModelError, match="positive"):
        kv_cache_scales(model, 3, FP8_KV_DTYPE, torch.device("cpu"))


def test_layer_caches_carry_views_of_their_layers_scales():
    kv = torch.zeros(3, 2, 4, 2, 1, 8, dtype=FP8_KV_DTYPE)
    scales = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    caches = layer_kv_caches(kv, scales)
    assert [(c.k_scale.item(), c.v_scale.item()) for c in caches] == [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]
    scales[1, 0] = 7.0  # views: a kernel reading the pointer sees the engine's tensor
    assert caches[1].k_scale.item() == 7.0
    assert caches[2].k_cache.data_ptr() == kv[2, 0].data_ptr()
    assert all(c.k_scale is None and c.v_scale is None for c in layer_kv_caches(kv.float(), None))


# --------------------------------------------------------------------------------------------------
# Store and attention (torch reference)
# --------------------------------------------------------------------------------------------------


def test_store_quantizes_with_each_scale_and_skips_padding():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(5, 2, 8, generator=gen)
    v = torch.randn(5, 2, 8, generator=gen)
    k_cache = torch.zeros(3, 4, 2, 8, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros(3, 4, 2, 8, dtype=FP8_KV_DTYPE)
    slots = torch.tensor([9, -1, 0, 4, 11])
    store_kvcache_torch(k, v, k_cache, v_cache, slots, _scale(K_SCALE), _scale(V_SCALE))
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    keep = [0, 2, 3, 4]
    assert torch.equal(_bytes(flat_k[slots[keep]]), _bytes(quantize_fp8(k[keep], K_SCALE)))
    assert torch.equal(_bytes(flat_v[slots[keep]]), _bytes(quantize_fp8(v[keep], V_SCALE)))
    written = torch.zeros(12, dtype=torch.bool)
    written[slots[keep]] = True
    assert not _bytes(flat_k[~written]).any() and not _bytes(flat_v[~written]).any()  # nothing else written
    with pytest.raises(AssertionError, match="scales"):
        store_kvcache(k, v, k_cache, v_cache, slots)  # an FP8 cache without its scales


def _fp8_case(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int):
    """A paged fp32 case, plus the same cache quantized to e4m3 (K by K_SCALE, V by V_SCALE)."""
    case = make_paged_case(context_lens, num_kv_heads, head_dim, block_size)
    k8, v8 = quantize_fp8(case.k_cache, K_SCALE), quantize_fp8(case.v_cache, V_SCALE)
    return case, k8, v8


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (8, 2, 32)])
def test_prefill_over_fp8_equals_dense_attention_on_the_dequantized_values(num_heads, num_kv_heads, head_dim):
    lens, new = [37, 9, 20], [13, 9, 1]  # cached prefixes of 24, 0 and 19 tokens
    case, k8, v8 = _fp8_case(lens, num_kv_heads, head_dim, block_size=4)
    scale = head_dim**-0.5
    queries = full_queries(lens, num_heads, head_dim, torch.float32)
    q = torch.cat([qs[-n:] for qs, n in zip(queries, new, strict=True)])
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k8, v8, cu, case.context_lens, case.block_tables, scale)
    out = paged_prefill_attention(*args, k_scale=_scale(K_SCALE), v_scale=_scale(V_SCALE))
    expected, exact = [], []
    for i, n in enumerate(new):
        k_deq = dequantize_fp8(quantize_fp8(case.keys[i], K_SCALE), K_SCALE)
        v_deq = dequantize_fp8(quantize_fp8(case.values[i], V_SCALE), V_SCALE)
        expected.append(dense_causal_attention(queries[i], k_deq, v_deq, scale)[-n:])
        exact.append(dense_causal_attention(queries[i], case.keys[i], case.values[i], scale)[-n:])
    torch.testing.assert_close(out, torch.cat(expected), rtol=0, atol=1e-5)
    # Against the unquantized cache: an FP8-sized difference, no more (and not none).
    full = paged_prefill_attention_torch(q, case.k_cache, case.v_cache, cu, case.context_lens, case.block_tables, scale)
    torch.testing.assert_close(full, torch.cat(exact), rtol=0, atol=1e-5)
    assert_fp8_sized_difference(out, full)


def assert_fp8_sized_difference(out: torch.Tensor, full: torch.Tensor) -> None:
    """out differs from full by quantization error: some, and at most one e4m3 step (2^-3) of the output's scale."""
    err = (out - full).abs().max().item()
    assert 1e-4 < err <= 2.0**-3 * full.abs().max().item(), err


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (9, 3, 64)])
def test_decode_over_fp8_equals_dense_attention_on_the_dequantized_values(num_heads, num_kv_heads, head_dim):
    lens = [1, 17, 40]
    case, k8, v8 = _fp8_case(lens, num_kv_heads, head_dim, block_size=8)
    scale = head_dim**-0.5
    q = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    out = paged_decode_attention(q, k8, v8, case.context_lens, case.block_tables, scale,
                                 k_scale=_scale(K_SCALE), v_scale=_scale(V_SCALE))  # fmt: skip
    full = paged_decode_attention_torch(q, case.k_cache, case.v_cache, case.context_lens, case.block_tables, scale)
    for i in range(len(lens)):
        k_deq = dequantize_fp8(quantize_fp8(case.keys[i], K_SCALE), K_SCALE)
        v_deq = dequantize_fp8(quantize_fp8(case.values[i], V_SCALE), V_SCALE)
        # The last position's row of causal attention is the decode query attending to everything.
        qi = q[i : i + 1].expand(lens[i], -1, -1)
        want = dense_causal_attention(qi, k_deq, v_deq, scale)[-1]
        torch.testing.assert_close(out[i], want, rtol=0, atol=1e-5)
    assert_fp8_sized_difference(out, full)


# --------------------------------------------------------------------------------------------------
# Re-rotated block copies (chunk KV reuse)
# --------------------------------------------------------------------------------------------------

HEAD_DIM = 16


def _fp8_kv(layers: int, blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(layers, 2, blocks, 4, 2, HEAD_DIM, generator=gen) * 3
    k_scales = torch.tensor([0.02, 0.07, 0.5][:layers])
    scales = torch.stack([k_scales, torch.full((layers,), 0.04)], dim=1)  # [layers, K/V]
    return quantize_fp8(values, scales.view(layers, 2, 1, 1, 1, 1)), k_scales


def test_fp8_copies_requantize_rotated_keys_with_each_layers_scale_and_copy_value_bytes():
    kv, k_scales = _fp8_kv(layers=3, blocks=10, seed=1)
    before = kv.clone()
    inv_freq = rope_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "default"})
    copies = [(0, 5, 40), (1, 6, 40), (2, 7, -3), (3, 8, 0)]
    copy_blocks_rerotated(kv, copies, inv_freq, k_scales)
    s = k_scales.view(3, 1, 1, 1)
    for src, dst, delta in copies:
        assert torch.equal(_bytes(kv[:, 1, dst]), _bytes(before[:, 1, src]))
        keys = rerotate_keys(dequantize_fp8(before[:, 0, src], s), inv_freq, delta)
        assert torch.equal(_bytes(kv[:, 0, dst]), _bytes(quantize_fp8(keys, s)))
    assert torch.equal(_bytes(kv[:, 0, 8]), _bytes(before[:, 0, 3]))  # delta 0: the same bytes
    assert not torch.equal(_bytes(kv[:, 0, 5]), _bytes(before[:, 0, 0]))
    untouched = [0, 1, 2, 3, 4, 9]
    assert torch.equal(_bytes(kv[:, :, untouched]), _bytes(before[:, :, untouched]))
    with pytest.raises(AssertionError, match="K scales"):
        copy_blocks_rerotated(kv, copies, inv_freq)


@pytest.mark.parametrize("delta", [1, 37, 2_900])
def test_an_fp8_key_moved_by_delta_and_back_stays_within_one_e4m3_rounding(delta):
    kv, k_scales = _fp8_kv(layers=2, blocks=3, seed=2)
    inv_freq = rope_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "default"})
    copy_blocks_rerotated(kv, [(0, 1, delta)], inv_freq, k_scales)
    copy_blocks_rerotated(kv, [(1, 2, -delta)], inv_freq, k_scales)
    s = k_scales.view(2, 1, 1, 1)
    orig, back = dequantize_fp8(kv[:, 0, 0], s), dequantize_fp8(kv[:, 0, 2], s)
    # Each rotation rounds once; rotations preserve a pair's length, so the two roundings of the
    # pair (x_i, x_{i+D/2}) add up to at most one e4m3 step (2^-3) of its length.
    half = HEAD_DIM // 2
    pair_len = torch.sqrt(orig[..., :half] ** 2 + orig[..., half:] ** 2).repeat(1, 1, 1, 2)
    err = (back - orig).abs()
    assert bool((err <= pair_len * 2.0**-3 + 2 * HALF_SUBNORMAL * s).all())
    assert err.max() > 0  # two real roundings happened
    # A copy that quantized without the scale (1.0) would land far away: the check above can fail.
    wrong = dequantize_fp8(quantize_fp8(rerotate_keys(dequantize_fp8(kv[:, 0, 1], s), inv_freq, -delta), 1.0), s)
    assert not bool(((wrong - orig).abs() <= pair_len * 2.0**-3 + 2 * HALF_SUBNORMAL * s).all())


# --------------------------------------------------------------------------------------------------
# Sizing
# --------------------------------------------------------------------------------------------------


def _model_config(layers: int = 32, kv_heads: int = 8, head_dim: int = 128) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False,
    )  # fmt: skip


def test_an_fp8_block_takes_half_the_bytes_of_bf16_and_a_quarter_of_fp32():
    config = _model_config()
    bf16 = block_bytes(config, 16, torch.bfloat16)
    assert bf16 == 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB, Llama-3.1-8B's block
    assert block_bytes(config, 16, FP8_KV_DTYPE) * 2 == bf16
    assert block_bytes(config, 16, FP8_KV_DTYPE) * 4 == block_bytes(config, 16, torch.float32)


def test_the_cpu_default_pool_holds_four_times_the_fp32_tokens_in_fp8():
    # Llama-8B shapes on CPU: the pool is capped in bytes (CPU_KV_CACHE_BYTES), so fp8 blocks count 4x.
    model = SimpleNamespace(config=_model_config())
    config = EngineConfig(max_num_seqs=256, block_size=16, device="cpu")
    cpu = torch.device("cpu")
    fp32 = decide_num_blocks(model, config, cpu, torch.float32, 8192)  # type: ignore[arg-type]
    fp8 = decide_num_blocks(model, config, cpu, torch.float32, 8192, FP8_KV_DTYPE)  # type: ignore[arg-type]
    assert fp32 == 128 and fp8 == 4 * fp32


def test_fp8_attention_reads_through_kv_cache_tuples():
    # The KVCache the layers get unpacks into cache and scales, in that order.
    kv = KVCache(torch.zeros(1), torch.zeros(1), _scale(2.0), _scale(3.0))
    k_cache, v_cache, k_scale, v_scale = kv
    assert (k_scale.item(), v_scale.item()) == (2.0, 3.0) and math.isclose(kv.v_scale.item(), 3.0)
