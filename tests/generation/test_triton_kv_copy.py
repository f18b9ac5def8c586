"""The one-launch copy of reused chunk KV blocks against the torch path (`copy_blocks_rerotated`)."""

from __future__ import annotations

import os

import pytest
import torch

from generation.layers.rerotation import copy_blocks_rerotated
from generation.layers.rotary import rope_inv_freq

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET, reason="needs a CUDA GPU"),
]


def _cache(layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    shape = (layers, 2, blocks, block_size, kv_heads, head_dim)
    return (torch.randn(*shape, generator=gen) * 2).to(dtype).to(DEVICE)


def _copies(num_blocks: int) -> list[tuple[int, int, int]]:
    # Four "chunks" of 5 blocks from the first half to the second, one delta each (negative, zero,
    # small, thousands: where Triton's own cos/sin would lose accuracy), plus a lone block.
    copies, dst = [], num_blocks // 2
    for chunk, delta in enumerate((-37, 0, 16, 2_900)):
        for b in range(5):
            copies.append((chunk * 5 + b, dst, delta))
            dst += 1
    copies.append((21, dst, 123_457))
    return copies


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 16, 8, 128), (2, 4, 3, 16)])  # Llama-8B's block; a block of odd rows
def test_triton_copy_equals_the_torch_path(dtype, shape):
    from generation.layers.triton_kv_copy import copy_rerotate_blocks

    layers, block_size, kv_heads, head_dim = shape
    num_blocks = 64
    inv_freq = rope_inv_freq(head_dim, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    inv_freq = inv_freq.to(DEVICE)
    copies = _copies(num_blocks)
    before = _cache(layers, num_blocks, block_size, kv_heads, head_dim, dtype)
    expected, out = before.clone(), before.clone()
    copy_blocks_rerotated(expected, copies, inv_freq)
    copy_rerotate_blocks(out, copies, inv_freq)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    dst = torch.tensor([d for _, d, _ in copies], device=DEVICE)
    untouched = torch.ones(num_blocks, dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    # Blocks no copy lands in (the sources among them) are not written.
    assert torch.equal(out[:, :, untouched], before[:, :, untouched])
    # Values are moved bit for bit, as are keys moved by a delta of 0.
    assert torch.equal(out[:, 1], expected[:, 1])
    zero = torch.tensor([d for _, d, delta in copies if delta == 0], device=DEVICE)
    assert torch.equal(out[:, 0, zero], before[:, 0, torch.tensor([s for s, _, delta in copies if delta == 0])])
    # Keys: the same fp32 rotation, rounded once. The compiler may fuse a product and a difference
    # into one FMA, which moves the fp32 result by up to an fp32 rounding of the products (about
    # 2**-24 of |x1| + |x2|, large against the result where they cancel); then one rounding to the
    # cache dtype, one ulp of it at most apart.
    src = torch.tensor([s for s, _, _ in copies], device=DEVICE)
    k_src = before[:, 0, src].float()
    half = head_dim // 2
    pair = k_src[..., :half].abs() + k_src[..., half:].abs()
    fp32_slack = 4 * 2.0**-24 * torch.cat((pair, pair), dim=-1)
    k_out, k_ref = out[:, 0, dst].float(), expected[:, 0, dst].float()
    info = torch.finfo(dtype)
    ulp = info.eps * torch.maximum(k_ref.abs(), k_out.abs()).clamp_min(info.tiny)
    assert ((k_out - k_ref).abs() <= ulp + fp32_slack).all()
    if dtype != torch.float32:  # a cancelling FMA rarely changes a 16-bit rounding
        assert (k_out == k_ref).float().mean() > 0.99
    # And the rotation did happen: a moved key differs from its source.
    moved = torch.tensor([d for _, d, delta in copies if delta == 2_900], device=DEVICE)
    assert not torch.equal(out[:, 0, moved], before[:, 0, moved - num_blocks // 2])


def test_no_copies_launches_nothing():
    from generation.layers.triton_kv_copy import copy_rerotate_blocks

    cache = _cache(1, 4, 4, 1, 16, torch.float32)
    before = cache.clone()
    copy_rerotate_blocks(cache, [], torch.ones(8, device=DEVICE))
    assert torch.equal(cache, before)
