"""Compile, at start, every variant of the Triton attention kernels that a step can need.

Triton compiles a kernel the first time it meets a new combination of constexpr values. The
attention kernels' integers and index pointers are not specialised (do_not_specialize), but two
constexprs still follow the step's shape: SPLIT (whether the keys are split over programs) and
the reduce kernel's BLOCK_S (the split count rounded up to a power of two). Serving met them one
at a time, and each new one stalled its step for a second or more while every waiting request
queued behind it (bench/rag_kv_reuse.py --trace-slow). The split count depends only on shapes
(attention_splits.py), so a walk over shapes finds one shape per variant; one tiny launch each
compiles them all.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from generation.layers.attention_splits import (
    PREFILL_SPLIT_MAX_TOKENS,
    decode_num_splits,
    prefill_num_splits,
    prefill_tile,
)

logger = logging.getLogger(__name__)

Variant = tuple[bool, int]  # (SPLIT, BLOCK_S)


def variant_of(num_splits: int) -> Variant:
    """The constexprs a split count selects: SPLIT and the reduce kernel's BLOCK_S."""
    return num_splits > 1, 1 << max(0, num_splits - 1).bit_length()


def dense_then_doubling(limit: int, dense: int) -> list[int]:
    """1..min(dense, limit), then doublings up to limit (included)."""
    out = list(range(1, min(dense, limit) + 1))
    while out[-1] < limit:
        out.append(min(limit, out[-1] * 2))
    return out


def variant_shapes(
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    max_prefill_tokens: int,
    device: torch.device,
) -> tuple[dict[Variant, tuple[int, int]], dict[Variant, tuple[int, int]]]:
    """One shape per kernel variant: ({variant: (batch, table width)} of decode, {variant: (new
    tokens, table width)} of prefill).

    The split count changes quickly at small batches, token counts and widths, and slowly past
    them (it is capped near DECODE_SPLIT_TARGET programs per SM), so the walk is dense there and
    in doublings beyond: ~10^5 evaluations, well under a second. tests/generation/
    test_kernel_warmup.py checks it against an exhaustive walk.
    """
    max_prefill_tokens = min(max_prefill_tokens, max_blocks_per_seq * block_size)
    widths = dense_then_doubling(max_blocks_per_seq, dense=1024)
    decodes: dict[Variant, tuple[int, int]] = {}
    for batch in dense_then_doubling(max_num_seqs, dense=32):
        for width in widths:
            splits, _ = decode_num_splits(batch, num_kv_heads, width * block_size, device)
            decodes.setdefault(variant_of(splits), (batch, width))
    _, block_q = prefill_tile(num_heads // num_kv_heads)
    prefills: dict[Variant, tuple[int, int]] = {}
    # Past PREFILL_SPLIT_MAX_TOKENS new tokens a prefill never splits: one more count covers them.
    split_max = min(PREFILL_SPLIT_MAX_TOKENS + 1, max_prefill_tokens)
    for tokens in sorted({*range(1, min(16, split_max) + 1), *range(8, split_max + 1, 8), split_max}):
        programs = (tokens // block_q + 1) * num_kv_heads
        for width in widths:
            if width * block_size < tokens:
                continue  # a step's table always holds its new tokens
            splits, _ = prefill_num_splits(tokens, programs, width * block_size, device)
            prefills.setdefault(variant_of(splits), (tokens, width))
    return decodes, prefills


@torch.inference_mode()
def compile_attention_variants(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    max_prefill_tokens: int,
    q_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> int:
    """Launch decode and prefill attention once per kernel variant (CUDA); returns the launches made.

    The launches read the engine's own cache, so an FP8 cache compiles the FP8 variants (the
    FP8_KV constexpr), which are the ones serving uses.

    Args:
        k_cache, v_cache: one layer's cache ([blocks, block_size, kv_heads, head_dim]); only read.
        num_heads: query heads.
        max_num_seqs: most rows of a decode step.
        max_blocks_per_seq: widest block table a step can have.
        max_prefill_tokens: most new tokens of a prefill step.
        q_dtype: the queries' dtype (the model's), the cache's when None (it must be given for an
            FP8 cache, whose dtype no query has).
        k_scale, v_scale: an FP8 cache's [1] fp32 scales; None otherwise.
    """
    # Here, not at module level: Triton is only there where CUDA is.
    from generation.layers import triton_attention, triton_decode

    started = time.monotonic()
    device, dtype = k_cache.device, q_dtype or k_cache.dtype
    assert dtype != torch.float8_e4m3fn, "an FP8 cache needs q_dtype, the model's dtype"
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    scale = head_dim**-0.5
    decodes, prefills = variant_shapes(
        num_heads, num_kv_heads, block_size, max_num_seqs, max_blocks_per_seq, max_prefill_tokens, device
    )
    for batch, width in decodes.values():
        q = torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(batch, width, dtype=torch.int32, device=device)
        lens = torch.ones(batch, dtype=torch.int32, device=device)
        triton_decode.paged_decode_attention(q, k_cache, v_cache, lens, tables, scale, **scales)
    for tokens, width in prefills.values():
        q = torch.zeros(tokens, num_heads, head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        lens = torch.tensor([tokens], dtype=torch.int32, device=device)
        tables = torch.zeros(1, width, dtype=torch.int32, device=device)
        triton_attention.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, scale, **scales)
    torch.cuda.synchronize(device)
    launches = len(decodes) + len(prefills)
    elapsed = time.monotonic() - started
    logger.info("compiled the attention kernels' variants (%d launches) in %.1f s", launches, elapsed)
    return launches


@contextlib.contextmanager
def recording_triton_compiles() -> Iterator[list[str]]:
    """Within the block, the names of the Triton kernels compiled (or loaded from Triton's disk cache).

    Each one stalled the step that needed it; serving should record none (test_kernel_variants,
    bench/rag_kv_reuse.py --trace-slow). Without Triton the list stays empty. The hook that was
    installed before is put back on exit.
    """
    compiled: list[str] = []
    try:
        import triton

        knobs = triton.knobs.runtime
    except (ImportError, AttributeError):  # no Triton, or one without runtime knobs
        yield compiled
        return

    def on_compile(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        fn = kwargs.get("fn")
        compiled.append(getattr(getattr(fn, "fn", fn), "__name__", str(fn)))

    previous = knobs.jit_post_compile_hook
    knobs.jit_post_compile_hook = on_compile
    try:
        yield compiled
    finally:
        knobs.jit_post_compile_hook = previous

