"""The start-up walk finds a shape for every attention-kernel variant a step can meet (CPU: shapes only)."""

from __future__ import annotations

import pytest
import torch

from generation.layers.attention_splits import decode_num_splits, prefill_num_splits, prefill_tile
from generation.layers.kernel_warmup import dense_then_doubling, variant_of, variant_shapes

CPU = torch.device("cpu")  # attention_splits assumes an H200's 132 SMs off CUDA


def test_variant_of_and_the_walk():
    assert [variant_of(n) for n in (1, 2, 3, 4, 5, 43, 65)] == [
        (False, 1), (True, 2), (True, 4), (True, 4), (True, 8), (True, 64), (True, 128),
    ]  # fmt: skip
    assert dense_then_doubling(5, dense=32) == [1, 2, 3, 4, 5]
    assert dense_then_doubling(100, dense=32)[-4:] == [31, 32, 64, 100]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "max_num_seqs", "max_blocks"),
    [(32, 8, 256, 512), (9, 3, 64, 128), (4, 2, 16, 32)],  # Llama-8B at 8k context, SmolLM2, the tiny test model
)
def test_the_walk_finds_every_variant_an_exhaustive_search_finds(heads, kv_heads, max_num_seqs, max_blocks):
    block_size = 16
    decodes, prefills = variant_shapes(heads, kv_heads, block_size, max_num_seqs, max_blocks, 8192, CPU)
    # Every decode shape: every batch size and every table width.
    every_decode = {
        variant_of(decode_num_splits(b, kv_heads, w * block_size, CPU)[0])
        for b in range(1, max_num_seqs + 1)
        for w in range(1, max_blocks + 1)
    }
    assert set(decodes) == every_decode
    # Every prefill shape of up to 4 sequences (more sequences only mean more programs, fewer splits).
    _, block_q = prefill_tile(heads // kv_heads)
    every_prefill = set()
    for tokens in range(1, min(8192, max_blocks * block_size) + 1, 1 if max_blocks <= 128 else 7):
        for seqs in (1, 2, 4):
            programs = (tokens // block_q + seqs) * kv_heads
            for w in range(-(-tokens // block_size), max_blocks + 1):
                every_prefill.add(variant_of(prefill_num_splits(tokens, programs, w * block_size, CPU)[0]))
    assert every_prefill <= set(prefills)
    # Each found shape really has its variant, and is a shape a step can have.
    for variant, (batch, width) in decodes.items():
        assert 1 <= batch <= max_num_seqs and 1 <= width <= max_blocks
        assert variant_of(decode_num_splits(batch, kv_heads, width * block_size, CPU)[0]) == variant
    for variant, (tokens, width) in prefills.items():
        assert width * block_size >= tokens and width <= max_blocks
        programs = (tokens // block_q + 1) * kv_heads
        assert variant_of(prefill_num_splits(tokens, programs, width * block_size, CPU)[0]) == variant


def test_the_compile_recorder_names_kernels_and_puts_the_old_hook_back(monkeypatch):
    # A stand-in for Triton's runtime knobs (Triton is not installed on CPU machines): the
    # recorder installs its hook, names what Triton reports, and restores the hook before it.
    import sys
    import types

    from generation.layers.kernel_warmup import recording_triton_compiles

    def before(*args, **kwargs):
        return None

    runtime = types.SimpleNamespace(jit_post_compile_hook=before)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))

    def _prefill_kernel():
        return None

    with recording_triton_compiles() as compiled:
        assert runtime.jit_post_compile_hook is not before
        runtime.jit_post_compile_hook(fn=types.SimpleNamespace(fn=_prefill_kernel))
        runtime.jit_post_compile_hook(fn=_prefill_kernel)
    assert compiled == ["_prefill_kernel", "_prefill_kernel"]
    assert runtime.jit_post_compile_hook is before


def test_the_compile_recorder_without_triton_records_nothing(monkeypatch):
    import sys

    from generation.layers.kernel_warmup import recording_triton_compiles

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with recording_triton_compiles() as compiled:
        pass
    assert compiled == []
