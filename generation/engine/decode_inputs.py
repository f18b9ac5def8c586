"""DecodeInputs: a pure-decode step's inputs packed in one int64 buffer, sent with one host-to-device copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    """A pure-decode step's inputs, written on the host and sent to the device with a single copy.

    Layout for a batch of `bs` rows: an int64 matrix [HEADER_ROWS + max_blocks, bs] at the start of
    the buffer, rows input_ids, positions, slot_mapping, context_lens, then the block table
    transposed (one row per block index). Transposed, the first `width` block columns of every
    sequence form a contiguous prefix of the buffer, so a step copies only (4 + width) * bs values
    however long max_model_len is. Block rows past `width` keep stale values: a sequence's decode
    reads only the blocks its context covers, all of them below `width`.

    On CUDA the host side is pinned and the copy is asynchronous; CUDA graphs read the device
    buffer in place (see DecodeGraphs). On CPU host and device buffers are the same tensor.

    Args:
        max_batch: most rows (the largest decode bucket).
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

    def write(self, entries: list[ScheduledEntry], bs: int) -> int:
        """Pack one decode per entry into rows 0..n-1 of a bs-row layout and copy it; returns the width.

        Rows n..bs-1 are padding: slot -1 (no KV written) and context 0 (nothing attended).
        Block columns past each row's own blocks up to the width hold -1.
        """
        bs_ = self.block_size
        n = len(entries)
        assert 0 < n <= bs <= self.max_batch
        header: list[list[int]] = [[], [], [], []]
        ids, positions, slots, context_lens = header
        tables: list[list[int]] = []
        for entry in entries:
            seq, pos = entry.seq, entry.start_pos
            table = seq.block_table
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(table[pos // bs_] * bs_ + pos % bs_)
            context_lens.append(pos + 1)
            tables.append(table[: pos // bs_ + 1])
        width = max(len(t) for t in tables)
        if self._copied is not None:
            self._copied.synchronize()
        grid = self._host_np[: (HEADER_ROWS + width) * bs].reshape(HEADER_ROWS + width, bs)
        grid[:HEADER_ROWS, :n] = header
        if n < bs:
            grid[:, n:] = 0
            grid[SLOTS, n:] = -1
        columns = grid[HEADER_ROWS:]
        columns[:, :n] = -1
        for row, table in enumerate(tables):
            columns[: len(table), row] = table
        if self._copied is not None:
            size = (HEADER_ROWS + width) * bs
            self.device_buffer[:size].copy_(self.host[:size], non_blocking=True)
            self._copied.record()
        return width


def block_table_rows(columns: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """[n, width] int32 contiguous block tables from transposed int64 block columns (eager steps)."""
    return columns[:width, :n].t().contiguous().to(torch.int32)
