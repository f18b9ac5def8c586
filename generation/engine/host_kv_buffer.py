"""HostKVBuffer: host memory for whole KV blocks (pinned on CUDA) and the copies in and out of the GPU pool."""

from __future__ import annotations

import logging

import torch

from generation.engine.kv_cache_sizing import GIB
from rag.errors import ModelError

logger = logging.getLogger(__name__)


class HostKVBuffer:
    """`num_blocks` host slots, each one block of the KV tensor in its own layout.

    The pool is `[layers, 2, blocks, block_size, kv_heads, head_dim]`; slot s holds what
    `kv_cache[:, :, b]` holds (`[layers, 2, block_size, kv_heads, head_dim]`), contiguous, so one
    block moves in one copy of its full size (2 MiB for Llama-3.1-8B in bf16), not one per layer:
    KV-REUSE.md A5 measured per-layer copies at ~7x the cost.

    On CUDA the buffer is pinned and the copies are asynchronous on the current stream: they run
    in program order with the steps, so a copy out reads a block after the step that computed it
    and before the step that reuses it. The host never reads the buffer itself.

    Args:
        kv_cache: the engine's KV tensor.
        num_blocks: host slots (>= 1).

    Raises:
        ModelError: the host memory cannot be allocated (pinned memory is limited by the OS).
    """

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int) -> None:
        self.kv_cache = kv_cache
        layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
        shape = (num_blocks, layers, two, block_size, kv_heads, head_dim)
        pin = kv_cache.device.type == "cuda"
        size_gib = num_blocks * kv_cache[:, :, 0].numel() * kv_cache.element_size() / GIB
        try:
            # Empty, not zeros: a slot is only ever read after a copy out wrote it.
            self.blocks = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=pin)
        except RuntimeError as exc:
            raise ModelError(
                f"cannot allocate the host KV tier ({num_blocks} blocks, {size_gib:.2f} GiB"
                f"{' pinned' if pin else ''}): {exc}. Lower host_kv_blocks or set it to 0 (off)."
            ) from exc
        logger.info("host KV tier: %d blocks, %.2f GiB%s", num_blocks, size_gib, " pinned" if pin else "")

    def swap_out(self, block_id: int, slot: int) -> None:
        """Copy GPU block block_id (every layer, K and V) into host slot `slot`."""
        with torch.no_grad():
            self.blocks[slot].copy_(self.kv_cache[:, :, block_id], non_blocking=True)

    def swap_in(self, slot: int, block_id: int) -> None:
        """Copy host slot `slot` into GPU block block_id."""
        with torch.no_grad():
            self.kv_cache[:, :, block_id].copy_(self.blocks[slot], non_blocking=True)
