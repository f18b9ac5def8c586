"""HostKVBuffer: host memory for whole KV blocks (pinned on CUDA) and the copies in and out of the GPU pool."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import torch

from generation.engine.copy_landing import CopyLanding
from generation.engine.kv_cache_sizing import GIB, STAGING_BLOCKS, staging_size
from generation.layers.kv_fp8 import as_bytes
from rag.errors import ModelError

logger = logging.getLogger(__name__)


class HostKVBuffer:
    """`num_blocks` host slots, each one block of the KV tensor in its own layout.

    The pool is `[layers, 2, blocks, block_size, kv_heads, head_dim]`; slot s holds what
    `kv_cache[:, :, b]` holds (`[layers, 2, block_size, kv_heads, head_dim]`), contiguous, so one
    block moves in one copy of its full size (2 MiB for Llama-3.1-8B in bf16), not one per layer:
    KV-REUSE.md A5 measured per-layer copies at ~7x the cost.

    On CUDA the buffer is pinned, and a copy out does not hold up the step after it. An evicted
    block is handed out at once and overwritten by that step, so its KV must be read first; the
    copy across PCIe (2 MiB per block at ~25 GB/s) used to run on the compute stream, before the
    step. Now `swap_out` only notes the block, and `before_step` (the model runner calls it before
    launching a step) gathers the noted blocks into a small GPU staging buffer on the compute
    stream (device to device: microseconds), then copies staging to host on a stream of its own,
    which runs while the step computes. Ordering:

    - the gather reads each block before the step that overwrites it (same stream, earlier);
    - a gather into staging waits for the host copies that still read it (`_busy`);
    - every write into host slots is on the copy stream, in order, so two writes to a slot reused
      by the tier land in the order they were issued;
    - `swap_in` first gathers what is noted (so a block noted for copying out is read before the
      copy back overwrites it), then copies host to GPU on the copy stream, after the compute
      stream's work so far (a block just freed may still be touched by a step in flight) and
      after every earlier copy out (a slot is never read before its copy out has landed, and a
      later copy out into it waits for the read);
    - the copies back of one restore are a group with one event (CopyLanding): `before_step`
      makes the compute stream wait only for the groups holding a block the step reads or
      writes, and a gather for a copy out waits for the groups of its blocks. A restore at a
      request's arrival thus runs beside the steps the request queues behind.

    More noted blocks than staging holds: the gather is done and staging is refilled after its
    copies (the step then waits for those, as before). The host never reads the buffer itself.

    The buffer and staging have the cache's dtype; an FP8 (e4m3) cache's blocks are copied
    through uint8 views of all three (float8 lacks some copy and index kernels): the same bytes
    come back, and the layer scales (ModelRunner.kv_scales) never change, so a block restored
    from the host reads exactly as it did before it left.

    Args:
        kv_cache: the engine's KV tensor.
        num_blocks: host slots (>= 1).
        staging_blocks: GPU staging blocks for the copies out (CUDA only; at most num_blocks;
            default STAGING_BLOCKS).

    Raises:
        ModelError: the host memory cannot be allocated (pinned memory is limited by the OS).
    """

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int, staging_blocks: int | None = None) -> None:
        self.kv_cache = kv_cache
        layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
        shape = (num_blocks, layers, two, block_size, kv_heads, head_dim)
        pin = kv_cache.device.type == "cuda"
        self.staging: torch.Tensor | None = None
        self.stream: torch.cuda.Stream | None = None
        if pin:
            self.staging = torch.empty(
                (staging_size(num_blocks, staging_blocks or STAGING_BLOCKS), *shape[1:]),
                dtype=kv_cache.dtype,
                device=kv_cache.device,
            )
            self.stream = torch.cuda.Stream(kv_cache.device)
        # Byte views for the copies (the tensors themselves unless the cache is FP8).
        self._kv = as_bytes(kv_cache)
        self._staging = as_bytes(self.staging) if self.staging is not None else None
        self._noted: list[tuple[int, int]] = []  # (GPU block, host slot) not gathered yet, in order
        self._busy: torch.cuda.Event | None = None  # after the last copy from staging to host
        self.landing = CopyLanding()  # copies back still in flight (CUDA only; on CPU they are done at once)
        # False: copies back run on the compute stream before the next step, as they did before
        # they overlapped (bench/rag_kv_reuse.py's "+host-inline" peer).
        self.overlap_copy_back = True
        size_gib = num_blocks * kv_cache[:, :, 0].numel() * kv_cache.element_size() / GIB
        try:
            # Empty, not zeros: a slot is only ever read after a copy out wrote it.
            self.blocks = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=pin)
        except RuntimeError as exc:
            raise ModelError(
                f"cannot allocate the host KV tier ({num_blocks} blocks, {size_gib:.2f} GiB"
                f"{' pinned' if pin else ''}): {exc}. Lower host_kv_blocks or set it to 0 (off)."
            ) from exc
        self._host = as_bytes(self.blocks)
        logger.info("host KV tier: %d blocks, %.2f GiB%s", num_blocks, size_gib, " pinned" if pin else "")

    def swap_out(self, block_id: int, slot: int) -> None:
        """Copy GPU block block_id (every layer, K and V) into host slot `slot`, before the next step."""
        if self.staging is None:
            with torch.no_grad():
                self._host[slot].copy_(self._kv[:, :, block_id])
            return
        if len(self._noted) == len(self.staging):
            self._copy_noted()
        self._noted.append((block_id, slot))

    def swap_in(self, slot: int, block_id: int) -> None:
        """Copy host slot `slot` into GPU block block_id (on CUDA beside the compute stream; see the class)."""
        with torch.no_grad():
            if self.staging is None:
                self._kv[:, :, block_id].copy_(self._host[slot])
                return
            if not self.overlap_copy_back:
                self._copy_noted()
                if self._busy is not None:  # the slot's copy out has landed
                    torch.cuda.current_stream(self.kv_cache.device).wait_event(self._busy)
                self._kv[:, :, block_id].copy_(self._host[slot], non_blocking=True)
                return
            if self._noted:
                self._copy_noted()  # closes the open group; the copy stream then follows the gather
            if not self.landing.is_open:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.kv_cache.device))
                self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                self._kv[:, :, block_id].copy_(self._host[slot], non_blocking=True)
            self.landing.add(block_id)

    def end_restore(self) -> None:
        """The copies back of one restore are all issued: they land, and are waited for, as one group."""
        if self.staging is not None:
            self._close_landing()

    def before_step(self, touched: Callable[[], Collection[int]] | None = None) -> None:
        """Before launching a step: gather the blocks noted for copying out and start their copies to
        host beside the step, and make the step wait for the copies back it needs.

        Args:
            touched: the GPU blocks the step reads or writes, asked for only while a copy back is in
                flight; None waits for every copy back.
        """
        if self.staging is None:
            return
        if self._noted:
            self._copy_noted()
        self._close_landing()
        compute = torch.cuda.current_stream(self.kv_cache.device)
        for event in self.landing.take_needed(touched):
            compute.wait_event(event)

    def synchronize(self) -> None:
        """Wait on the host until every copy issued so far has landed (timing, tests)."""
        self.before_step()
        if self.stream is not None:
            self.stream.synchronize()
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
            self.landing.prune()

    @property
    def num_staging_blocks(self) -> int:
        return 0 if self.staging is None else len(self.staging)

    def _close_landing(self) -> None:
        def record() -> torch.cuda.Event:
            event = torch.cuda.Event()
            event.record(self.stream)
            return event

        self.landing.close(record)

    def _copy_noted(self) -> None:
        if not self._noted:
            return
        compute = torch.cuda.current_stream(self.kv_cache.device)
        self._close_landing()  # copies out issued below are not part of the copies back before them
        noted = {block_id for block_id, _ in self._noted}
        with torch.no_grad():
            for event in self.landing.take_needed(lambda: noted):
                compute.wait_event(event)  # a block restored, then evicted before its copy back landed
            if self._busy is not None:
                compute.wait_event(self._busy)  # staging is still being read by the last copies
            for i, (block_id, _) in enumerate(self._noted):
                self._staging[i].copy_(self._kv[:, :, block_id])
            gathered = torch.cuda.Event()
            gathered.record(compute)
            self.stream.wait_event(gathered)
            with torch.cuda.stream(self.stream):
                for i, (_, slot) in enumerate(self._noted):
                    self._host[slot].copy_(self._staging[i], non_blocking=True)
                self._busy = torch.cuda.Event()
                self._busy.record(self.stream)
        self._noted.clear()
