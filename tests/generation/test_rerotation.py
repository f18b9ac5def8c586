"""Moving cached, rotated keys by a position delta equals rotating the raw keys at the new position."""

from __future__ import annotations

import pytest
import torch

from generation.config import _rope_scaling, _rope_theta
from generation.layers.rerotation import check_rerotatable, copy_blocks_rerotated, rerotate_keys
from generation.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

from .conftest import tiny_hf_config

HEAD_DIM = 16


def _rope_of(variant: str) -> RotaryEmbedding:
    # The engine's own reading of the config (transformers 4.x and 5.x spell rope settings differently).
    hf = tiny_hf_config(variant)
    return RotaryEmbedding(HEAD_DIM, _rope_theta(hf), _rope_scaling(hf), max_positions=4096)


def _rotated(rope: RotaryEmbedding, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # k [T, H, D] rotated at positions [T] the way the engine's torch path does it.
    cos, sin = rope(positions[None], torch.float32)  # [1, 1, T, D]
    kt = k.transpose(0, 1)[None]  # [1, H, T, D]
    _, out = apply_rotary(kt, kt, cos, sin)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("variant", ["default", "linear", "llama3"])
@pytest.mark.parametrize("delta", [1, 37, 500, -20])
def test_delta_rotation_equals_rope_at_the_new_position(variant, delta):
    rope = _rope_of(variant)
    torch.manual_seed(0)
    k = torch.randn(48, 2, HEAD_DIM)
    positions = torch.arange(100, 148)
    moved = rerotate_keys(_rotated(rope, k, positions), rope.inv_freq, delta)
    direct = _rotated(rope, k, positions + delta)
    # The direct path's fp32 angle p * omega (p ~ 600) is itself rounded by ~3e-5 rad: that, not
    # the delta rotation, sets the tolerance. A wrong frequency errs by > 0.1 (test below).
    torch.testing.assert_close(moved, direct, rtol=0, atol=1e-4)


def test_llama3_variant_exercises_all_three_bands():
    # The test above is only a test of llama3 if the tiny config puts frequencies in every band.
    rope = _rope_of("llama3")
    plain = rope_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "default"})
    ratio = rope.inv_freq / plain
    assert (ratio == 1).any() and (ratio == 1 / 8).any() and ((ratio > 1 / 8) & (ratio < 1)).any()


def test_an_unscaled_table_would_be_wrong_on_llama3():
    # Why the model's own (scaled) frequencies must be used: LMCache's unscaled table errs here.
    rope = _rope_of("llama3")
    k = torch.randn(8, 2, HEAD_DIM)
    positions = torch.arange(8)
    unscaled = rope_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "default"})
    wrong = rerotate_keys(_rotated(rope, k, positions), unscaled, 200)
    assert (wrong - _rotated(rope, k, positions + 200)).abs().max() > 0.1


def test_delta_zero_is_an_exact_copy():
    k = torch.randn(4, 2, HEAD_DIM, dtype=torch.bfloat16)
    out = rerotate_keys(k, torch.ones(HEAD_DIM // 2), 0)
    assert torch.equal(out, k) and out.data_ptr() != k.data_ptr()


def test_bf16_keys_are_rounded_once():
    rope = _rope_of("default")
    k = torch.randn(32, 2, HEAD_DIM)
    positions = torch.arange(32)
    cached = _rotated(rope, k, positions).to(torch.bfloat16)
    moved = rerotate_keys(cached, rope.inv_freq, 300)
    assert moved.dtype == torch.bfloat16
    # One fp32 rotation of the bf16 input, then one rounding: within one bf16 ulp of the fp32 result.
    exact = rerotate_keys(cached.float(), rope.inv_freq, 300)
    torch.testing.assert_close(moved.float(), exact, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "yarn"])
def test_length_dependent_schemes_are_refused(rope_type):
    with pytest.raises(ValueError, match="kv_reuse=\"exact\""):
        check_rerotatable({"rope_type": rope_type, "factor": 2.0})


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_fixed_frequency_schemes_are_accepted(rope_type):
    check_rerotatable({"rope_type": rope_type})


def test_block_copies_move_each_block_by_its_own_delta():
    # copy_blocks_rerotated groups copies by delta; each destination must still get its own.
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, 10, 4, 2, HEAD_DIM, generator=gen)  # [layers, K/V, blocks, size, heads, dim]
    before = cache.clone()
    inv_freq = _rope_of("default").inv_freq
    copies = [(0, 5, 40), (1, 6, 40), (2, 7, -3), (3, 8, 0)]
    copy_blocks_rerotated(cache, copies, inv_freq)
    for src, dst, delta in copies:
        assert torch.equal(cache[:, 1, dst], before[:, 1, src])
        assert torch.equal(cache[:, 0, dst], rerotate_keys(before[:, 0, src], inv_freq, delta))
    untouched = [0, 1, 2, 3, 4, 9]
    assert torch.equal(cache[:, :, untouched], before[:, :, untouched])
