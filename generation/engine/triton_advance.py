"""Triton kernel that moves packed decode inputs on by one token on the device (CUDA only).

It lives in engine/, beside decode_inputs.py, not in layers/ with the other triton_* modules:
it rewrites DecodeInputs' packed buffer between the steps of a multi-step batch (engine
bookkeeping, tied to that layout), while layers/ holds the model's building blocks, which
kernel_choice picks per tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One launch instead of the eight small torch ops of DecodeInputs.advance's CPU form: between the
# steps of a multi-step batch the GPU would otherwise spend more time on launches than on the work.


@triton.jit
def _advance_kernel(buffer_ptr, tokens_ptr, num_rows, bs, width, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < num_rows
    # Layout rows of the packed matrix [4 + max_blocks, bs]: ids, positions, slots, context lengths, blocks.
    pos = tl.load(buffer_ptr + bs + rows, mask=live, other=0) + 1
    col = pos // BLOCK_SIZE
    has_col = live & (col < width)
    block = tl.load(buffer_ptr + (4 + col) * bs + rows, mask=has_col, other=-1)
    ok = has_col & (block >= 0)
    tl.store(buffer_ptr + rows, tl.load(tokens_ptr + rows, mask=live), mask=live)
    tl.store(buffer_ptr + bs + rows, pos, mask=ok)
    tl.store(buffer_ptr + 3 * bs + rows, pos + 1, mask=ok)
    slot = tl.where(ok, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(buffer_ptr + 2 * bs + rows, slot, mask=live)


def advance_decode_rows(
    buffer: torch.Tensor, tokens: torch.Tensor, num_rows: int, bs: int, width: int, block_size: int
) -> None:
    """DecodeInputs.advance on a CUDA buffer: rows < num_rows of the bs-row layout, `width` block columns."""
    assert buffer.dtype == torch.int64 and tokens.dtype == torch.int64 and tokens.is_contiguous()
    block = min(1024, triton.next_power_of_2(num_rows))
    _advance_kernel[(triton.cdiv(num_rows, block),)](
        buffer, tokens, num_rows, bs, width, BLOCK_SIZE=block_size, BLOCK=block
    )
