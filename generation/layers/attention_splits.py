"""How the Triton attention kernels split their keys over programs: shapes only, no Triton (testable on CPU).

Both kernels split a long context over several programs per (sequence, KV head) when the batch
alone would leave SMs idle, and a reduce kernel merges the partial results. The split count is a
function of the step's shapes, never of its data, so CUDA graphs can capture it and
`kernel_warmup` can list every kernel variant a step can need.
"""

from __future__ import annotations

import functools
import math

import torch

DECODE_KEYS = 64  # keys per decode iteration
# Aim for this many decode programs per SM before splitting the context. Measured on an H200, batch 1,
# Llama-8B heads: 4 gave 39 us at a 32k context against 48 us with 2, the same at 512 and 4096 tokens.
DECODE_SPLIT_TARGET = 4
PREFILL_ROWS = 128  # query rows (token, head) per prefill program
PREFILL_KEYS = 64  # keys per prefill iteration
# Prefill steps of at most this many tokens may split their keys over programs (see prefill_num_splits).
PREFILL_SPLIT_MAX_TOKENS = 512
PREFILL_MAX_SPLITS = 16


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (132, an H100/H200's, off CUDA: the Triton interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a decode launch.

    Splits only when batch * KV heads programs would leave SMs idle, and never below one key tile
    per split. Depends only on shapes (never on context_lens), so CUDA graphs can capture it.
    """
    chunks = max(1, math.ceil(max_tokens / DECODE_KEYS))
    wanted = math.ceil(DECODE_SPLIT_TARGET * num_sms(device) / max(1, batch * num_kv_heads))
    num_splits = max(1, min(chunks, wanted))
    tokens_per_split = math.ceil(chunks / num_splits) * DECODE_KEYS
    return math.ceil(max_tokens / tokens_per_split), tokens_per_split


def prefill_tile(group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q) of a prefill program: rows of (token, query head), a power of two, and the
    new tokens they hold (group query heads per token)."""
    block_m = max(PREFILL_ROWS, 1 << max(0, group - 1).bit_length())
    return block_m, block_m // group


def prefill_num_splits(num_tokens: int, programs: int, max_context: int, device: torch.device) -> tuple[int, int]:
    """(num_splits, tokens_per_split) for a prefill launch of `programs` (tile, KV head) programs.

    A few hundred new tokens over a long cached prefix (a question after its cached documents)
    make few programs, each walking the whole context: split the keys over programs as decode
    does. Larger steps fill the GPU unsplit. Depends only on shapes, so CUDA graphs can capture it.
    """
    chunks = max(1, math.ceil(max_context / PREFILL_KEYS))
    if num_tokens > PREFILL_SPLIT_MAX_TOKENS:
        return 1, chunks * PREFILL_KEYS
    wanted = math.ceil(DECODE_SPLIT_TARGET * num_sms(device) / max(1, programs))
    num_splits = max(1, min(chunks, wanted, PREFILL_MAX_SPLITS))
    tokens_per_split = math.ceil(chunks / num_splits) * PREFILL_KEYS
    return math.ceil(max_context / tokens_per_split), tokens_per_split
