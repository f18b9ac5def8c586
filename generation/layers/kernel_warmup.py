"""Compile, at start, every variant of the Triton attention kernels that a step can need.

Triton compiles a kernel the first time it meets a new combination of constexpr values. The
attention kernels' integers are not specialised (do_not_specialize), but two constexprs still
follow the step's shape: SPLIT (whether the keys are split over programs) and the reduce kernel's
BLOCK_S (the split count rounded up to a power of two). Serving met them one at a time, and each
new one stalled its step for a second or more while every waiting request queued behind it. The
split decision depends only on shapes (batch size, table width, new tokens), so walking those
shapes in powers of two reaches every variant; one tiny launch per variant compiles it.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


def _dense_then_doubling(limit: int, dense: int) -> list[int]:
    """1..min(dense, limit), then doublings up to limit (included)."""
    out = list(range(1, min(dense, limit) + 1))
    while out[-1] < limit:
        out.append(min(limit, out[-1] * 2))
    return out


def _variant(num_splits: int) -> tuple[bool, int]:
    """The constexprs a split count selects: SPLIT and the reduce kernel's BLOCK_S."""
    return num_splits > 1, 1 << max(0, num_splits - 1).bit_length()


@torch.inference_mode()
def compile_attention_variants(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    max_prefill_tokens: int,
) -> int:
    """Launch decode and prefill attention once per kernel variant; returns the launches made.

    Args:
        k_cache, v_cache: one layer's cache ([blocks, block_size, kv_heads, head_dim]); only read.
        num_heads: query heads.
        max_num_seqs: most rows of a decode step.
        max_blocks_per_seq: widest block table a step can have.
        max_prefill_tokens: most new tokens of a prefill step.
    """
    # Here, not at module level: Triton is only there where CUDA is.
    from generation.layers import triton_attention, triton_decode

    started = time.monotonic()
    device, dtype = k_cache.device, k_cache.dtype
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5
    max_prefill_tokens = min(max_prefill_tokens, max_blocks_per_seq * block_size)
    # Every shape's variant is a cheap function of the shape: find one shape per variant, then
    # launch only those. The split count changes quickly at small batches, token counts and
    # widths and slowly past them (it is capped near DECODE_SPLIT_TARGET programs per SM), so
    # the walk is dense there and in powers of two beyond: ~10^5 evaluations, under a second.
    widths = _dense_then_doubling(max_blocks_per_seq, dense=1024)
    decodes: dict[tuple[bool, int], tuple[int, int]] = {}
    for batch in _dense_then_doubling(max_num_seqs, dense=32):
        for width in widths:
            splits, _ = triton_decode.decode_num_splits(batch, num_kv_heads, width * block_size, device)
            decodes.setdefault(_variant(splits), (batch, width))
    block_m = max(triton_attention._PREFILL_ROWS, 1 << max(0, group - 1).bit_length())
    block_q = block_m // group
    prefills: dict[tuple[bool, int], tuple[int, int]] = {}
    # Past _PREFILL_SPLIT_MAX_TOKENS new tokens a prefill never splits: one more count covers them.
    split_max = min(triton_attention._PREFILL_SPLIT_MAX_TOKENS + 1, max_prefill_tokens)
    for tokens in sorted({*range(1, min(16, split_max) + 1), *range(8, split_max + 1, 8), split_max}):
        for width in widths:
            if width * block_size < tokens:
                continue  # a step's table always holds its new tokens
            programs = (tokens // block_q + 1) * num_kv_heads
            splits, _ = triton_attention.prefill_num_splits(tokens, programs, width * block_size, device)
            prefills.setdefault(_variant(splits), (tokens, width))
    for batch, width in decodes.values():
        q = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
        lens = torch.ones(batch, dtype=torch.int32, device=device)
        triton_decode.paged_decode_attention(q, k_cache, v_cache, lens, tables, scale)
    for tokens, width in prefills.values():
        q = torch.zeros(tokens, num_heads, head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        lens = torch.tensor([tokens], dtype=torch.int32, device=device)
        tables = torch.zeros(1, width, dtype=torch.int32, device=device)
        triton_attention.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale)
    launches = len(decodes) + len(prefills)
    torch.cuda.synchronize(device)
    elapsed = time.monotonic() - started
    logger.info("compiled the attention kernels' variants (%d launches) in %.1f s", launches, elapsed)
    return launches
