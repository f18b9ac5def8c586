"""DecodeInputs: a decode step's inputs packed in one int64 buffer, sent with one copy and advanced on the device."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from generation.engine.scheduler import ScheduledEntry

# Rows of the packed layout before the block-table columns.
INPUT_IDS, POSITIONS, SLOTS, CONTEXT_LENS = range(4)
HEADER_ROWS = 4


@dataclass(frozen=True)
class DecodeFields:
    """Device views of the packed buffer for a batch of `bs` rows (int64 throughout)."""

    input_ids: torch.Tensor  # [bs]
    positions: torch.Tensor  # [bs]
    slot_mapping: torch.Tensor  # [bs], -1 on padding rows
    context_lens: torch.Tensor  # [bs], 0 on padding rows
    block_columns: torch.Tensor  # [max_blocks, bs]: the block table transposed, column j of row i at [j, i]


class DecodeInputs:
    """A decode step's inputs, written on the host, sent with a single copy, then advanced on the device.

    Layout for a batch of `bs` rows: an int64 matrix [HEADER_ROWS + max_blocks, bs] at the start of
    the buffer, rows input_ids, positions, slot_mapping, context_lens, then the block table
    transposed (one row per block index). Transposed, the first `width` block columns of every
    sequence form a contiguous prefix of the buffer, so a write copies only (4 + width) * bs values
    however long max_model_len is. Block rows past `width` keep stale values: nothing reads them
    (attention reads the blocks a context covers, `advance` checks the width).

    A batch that runs several steps is written once, at the last token each entry feeds in its
    first step; `advance` then moves every row on by one token on the device, fed the token the
    step before sampled, so later steps need neither the host nor a sync.

    On CUDA the host side is pinned and the copy is asynchronous; CUDA graphs read the device
    buffer in place (see DecodeGraphs). On CPU host and device buffers are the same tensor.

    Args:
        max_batch: most rows (the largest decode batch).
        max_blocks: block-table width of a max_model_len sequence.
        block_size: tokens per KV block.
        device: where the model runs.
    """

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        numel = (HEADER_ROWS + max_blocks) * max_batch
        cuda = device.type == "cuda"
        self.host = torch.zeros(numel, dtype=torch.int64, pin_memory=cuda)
        self._host_np = self.host.numpy()
        self.device_buffer = torch.zeros(numel, dtype=torch.int64, device=device) if cuda else self.host
        # Recorded after each copy: the host buffer must not be rewritten while a copy still reads it.
        self._copied = torch.cuda.Event() if cuda else None
        self._fields: dict[int, DecodeFields] = {}
        # Layout of the last write: rows of the layout, real rows, block columns packed.
        self.bs = self.num_rows = self.width = 0

    def fields(self, bs: int) -> DecodeFields:
        """Device views for a batch of bs rows (fixed addresses: CUDA graphs capture them)."""
        if bs not in self._fields:  # views made once per size: building them costs more than a step's packing
            self._fields[bs] = self._make_fields(bs)
        return self._fields[bs]

    def _make_fields(self, bs: int) -> DecodeFields:
        grid = self.device_buffer[: (HEADER_ROWS + self.max_blocks) * bs].view(HEADER_ROWS + self.max_blocks, bs)
        return DecodeFields(grid[INPUT_IDS], grid[POSITIONS], grid[SLOTS], grid[CONTEXT_LENS], grid[HEADER_ROWS:])

    def reset(self, bs: int) -> None:
        """Device buffer as an all-padding batch of bs rows (for warm-up and capture)."""
        self.device_buffer.zero_()
        self.fields(bs).slot_mapping.fill_(-1)

    def write(self, entries: Sequence[ScheduledEntry], bs: int) -> int:
        """Pack one row per entry, at the last token it feeds this step, into a bs-row layout; returns the width.

        For a decode entry that is the step's input. The block table of each row is packed whole
        (a batch of several steps has its later blocks reserved already). Rows n..bs-1 are
        padding: slot -1 (no KV written) and context 0 (nothing attended); block columns past
        each row's own blocks hold -1.
        """
        block_size = self.block_size
        n = len(entries)
        assert 0 < n <= bs <= self.max_batch
        positions = [e.start_pos + e.num_new_tokens - 1 for e in entries]
        tables = [e.seq.block_table for e in entries]
        ids = [e.seq.token_ids[p] for e, p in zip(entries, positions, strict=True)]
        slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions, strict=True)]
        lens = [len(t) for t in tables]
        width = max(lens)
        assert width <= self.max_blocks
        if self._copied is not None:
            self._copied.synchronize()
        grid = self._host_np[: (HEADER_ROWS + width) * bs].reshape(HEADER_ROWS + width, bs)
        grid[INPUT_IDS, :n] = ids
        grid[POSITIONS, :n] = positions
        grid[SLOTS, :n] = slots
        grid[CONTEXT_LENS, :n] = positions
        grid[CONTEXT_LENS, :n] += 1
        if n < bs:
            grid[:, n:] = 0
            grid[SLOTS, n:] = -1
        columns = grid[HEADER_ROWS:]
        columns[:, :n] = -1
        # One scatter for all rows: per-row numpy assignments cost more than the rest of a step.
        counts = np.asarray(lens)
        rows = np.repeat(np.arange(n), counts)
        cols = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
        columns[cols, rows] = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=rows.size)
        if self._copied is not None:
            size = (HEADER_ROWS + width) * bs
            self.device_buffer[:size].copy_(self.host[:size], non_blocking=True)
            self._copied.record()
        self.bs, self.num_rows, self.width = bs, n, width
        return width

    def advance(self, tokens: torch.Tensor) -> None:
        """Move the rows of the last write on by one token, fed `tokens` ([num_rows] int64), on the device.

        A row whose next position has no block (its lookahead ended: it is past max_tokens or
        max_model_len) stays where it is and stores nothing; its later tokens are discarded.
        """
        fields = self.fields(self.bs)
        n = self.num_rows
        if self.device_buffer.is_cuda:
            from generation.engine.triton_advance import advance_decode_rows

            advance_decode_rows(self.device_buffer, tokens, n, self.bs, self.width, self.block_size)
            return
        # The torch form of the kernel (CPU): the same rule, a few vector ops.
        pos = fields.positions[:n] + 1
        col = torch.div(pos, self.block_size, rounding_mode="floor")
        block = fields.block_columns[: self.width, :n].gather(0, col.clamp(max=self.width - 1)[None])[0]
        ok = (col < self.width) & (block >= 0)
        fields.input_ids[:n] = tokens
        fields.positions[:n] = torch.where(ok, pos, fields.positions[:n])
        fields.context_lens[:n] = torch.where(ok, pos + 1, fields.context_lens[:n])
        fields.slot_mapping[:n] = torch.where(ok, block * self.block_size + pos % self.block_size, -1)


def block_table_rows(columns: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """[n, width] int32 contiguous block tables from transposed int64 block columns (eager steps)."""
    return columns[:width, :n].t().contiguous().to(torch.int32)
