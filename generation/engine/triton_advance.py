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

_ROWS = 128  # rows per program

# One launch instead of the eight small torch ops of DecodeInputs.advance's CPU form: between the
# steps of a multi-step batch the GPU would otherwise spend more time on launches than on the work.


# Integer arguments are not specialised (Triton compiles a variant per "== 1" and "% 16 == 0" of
# each one by default): a batch size or table width not seen before must not compile a kernel, a
# second-long stall, in the middle of serving.
@triton.jit(do_not_specialize=["num_rows", "bs", "width"])
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
    # One block size for every batch: a power of two per batch size would be a variant each.
    _advance_kernel[(triton.cdiv(num_rows, _ROWS),)](
        buffer, tokens, num_rows, bs, width, BLOCK_SIZE=block_size, BLOCK=_ROWS
    )
