"""HostKVTier: published KV blocks the GPU pool evicts, kept in a bounded host buffer and copied back on a hit.

Issue 16 item 5, KV-REUSE.md A5/B7. When the prefix cache evicts a published block, its KV is
copied once into a host slot, filed under the block's exact prefix-cache key (namespace key,
parent hash, token ids). A later GPU miss that finds the same exact key here takes a GPU block,
copies the KV back and publishes it again, as if it had been computed. Isolation carries over
because the key is the prefix cache's, compared in full (never only through the hash): a host
entry is only ever found by the same namespace, prefix and text.

Which blocks (admission): a published block the GPU evicts is copied out only if it was used at
least `admit_uses` times (1 by default) while it was on the GPU: hits on it, plus one for the
blocks of a chunk's compile, which the chunk doorkeeper only queues for a chunk retrieved twice.
A block computed once and never shared (a prompt's tail past its first differing source, a cold
chunk in place) is not worth the PCIe copy: exact-prefix traffic evicts mostly such blocks, and
admitting them all cost those modes throughput (docs/benchmarks.md). Which kind of chain a block
belongs to does not matter: a chunk's chain `head ‖ chunk`, the shared head and a conversation's
history are ordinary exact chains, and the priority below keeps the popular ones.

Eviction from the host tier: GDSF with uniform cost and size (whole blocks): priority =
clock + frequency, where frequency counts the block's uses (hits on the GPU while it was there,
plus host hits) and clock is the priority of the last entry evicted. Frequent blocks stay; the
clock ages them, so a block popular long ago loses to one used often lately; ties go to the
least recently used. A block already held here is not copied again (swap out once, RAGCache).

No torch here: the copies go through a `KVBlockCopier` (the model runner's HostKVBuffer), which
orders them so that a copy out always reads a block before its reuse overwrites it, a copy back
reads a slot before a later copy out reuses it, and a step waits for the copies back it reads
(on CUDA they run on a copy stream beside the steps; see HostKVBuffer).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from generation.engine.cache_namespaces import NamespaceKey
from generation.engine.prefix_cache import is_same_block


class KVBlockCopier(Protocol):
    """Moves one whole KV block (every layer, K and V) between the GPU pool and a host slot."""

    def swap_out(self, block_id: int, slot: int) -> None: ...

    def swap_in(self, slot: int, block_id: int) -> None: ...

    def end_restore(self) -> None:
        """The swap_ins of one restore are all issued (they may be waited for as one group)."""


@dataclass(slots=True)
class HostEntry:
    """One block held on the host: its slot, its exact prefix-cache key and its priority."""

    slot: int
    block_hash: bytes
    namespace: NamespaceKey
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    frequency: int
    priority: int
    tick: int  # the last use, for ties (least recently used first) and for stale heap items


class HostKVTier:
    """A bounded host-memory tier under the prefix cache.

    Args:
        num_blocks: host slots (>= 1).
        copier: carries out the copies; slot indices are in [0, num_blocks).
        admit_uses: uses on the GPU a block needs to be copied out (>= 0; 0 admits every block).

    Raises:
        ValueError: num_blocks < 1 or admit_uses < 0.
    """

    def __init__(self, num_blocks: int, copier: KVBlockCopier, admit_uses: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"host_kv_blocks must be >= 1 for a host tier, got {num_blocks}")
        if admit_uses < 0:
            raise ValueError(f"host_kv_admit_uses must be >= 0 (0 admits every block), got {admit_uses}")
        self.capacity = num_blocks
        self.copier = copier
        self.admit_uses = admit_uses
        self._entries: dict[bytes, HostEntry] = {}
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        # (priority, tick, hash), lowest first; an item is stale when its entry's tick moved on.
        self._heap: list[tuple[int, int, bytes]] = []
        self._clock = 0
        self._ticks = itertools.count(1)
        self.num_hits = 0  # GPU misses found here
        self.num_swapped_out = 0  # blocks copied to the host
        self.num_swapped_in = 0  # blocks copied back to the GPU
        self.num_evictions = 0  # host entries dropped for room
        self.num_not_admitted = 0  # evicted blocks used too rarely to be copied out

    @property
    def num_used_blocks(self) -> int:
        return len(self._entries)

    def find(
        self, block_hash: bytes, namespace: NamespaceKey, parent_hash: bytes | None, token_ids: Sequence[int]
    ) -> int | None:
        """The slot holding exactly this block (same namespace key, parent, tokens), or None; no side effects."""
        entry = self._entries.get(block_hash)
        if entry is None:
            return None
        return entry.slot if is_same_block(entry, namespace, parent_hash, token_ids) else None

    def save(
        self,
        block_id: int,
        block_hash: bytes,
        namespace: NamespaceKey,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        uses: int,
    ) -> None:
        """The GPU pool evicts a published block used `uses` times: keep its KV here (copied once)."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            if self.find(block_hash, namespace, parent_hash, token_ids) is not None:
                self._use(entry, uses)  # already here (restored earlier): no second copy
            return  # a hash held by another key cannot happen in practice; never overwrite it
        if uses < self.admit_uses:
            self.num_not_admitted += 1
            return
        if not self._free_slots:
            self._evict()
        slot = self._free_slots.pop()
        entry = HostEntry(slot, block_hash, namespace, parent_hash, tuple(token_ids), 0, 0, 0)
        self._entries[block_hash] = entry
        self._use(entry, max(1, uses))
        self.copier.swap_out(block_id, slot)
        self.num_swapped_out += 1

    def restore(self, slot: int, block_hash: bytes, block_id: int) -> None:
        """Copy a found entry's KV into GPU block block_id (a hit: one more use)."""
        entry = self._entries[block_hash]
        assert entry.slot == slot
        self._use(entry, 1)
        self.copier.swap_in(slot, block_id)
        self.num_hits += 1
        self.num_swapped_in += 1

    def end_restore(self) -> None:
        """A restore (one chain's copies back) is complete: the copier may close their group."""
        self.copier.end_restore()

    def clear(self) -> int:
        """Forget every entry (a cache reset); returns how many were dropped."""
        dropped = len(self._entries)
        self._entries.clear()
        self._heap.clear()
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        self._clock = 0
        return dropped

    def check_invariants(self) -> None:
        """Raise AssertionError if slots or entries disagree (for tests)."""
        slots = [e.slot for e in self._entries.values()]
        _check(len(set(slots)) == len(slots), "two host entries share a slot")
        _check(not set(slots) & set(self._free_slots), "a host slot is both used and free")
        _check(len(slots) + len(self._free_slots) == self.capacity, "host slots lost or duplicated")
        _check(len(set(self._free_slots)) == len(self._free_slots), "a host slot is free twice")
        for block_hash, entry in self._entries.items():
            _check(entry.block_hash == block_hash, "a host entry is filed under another hash")

    def _use(self, entry: HostEntry, uses: int) -> None:
        entry.frequency += uses
        entry.priority = self._clock + entry.frequency
        entry.tick = next(self._ticks)
        heapq.heappush(self._heap, (entry.priority, entry.tick, entry.block_hash))
        # Each use leaves the entry's older item stale; rebuild when stale ones dominate, so the
        # heap stays within a few times the entries however often a hot block is used.
        if len(self._heap) > 4 * len(self._entries) + 64:
            self._heap = [(e.priority, e.tick, h) for h, e in self._entries.items()]
            heapq.heapify(self._heap)

    def _evict(self) -> None:
        while True:
            priority, tick, block_hash = heapq.heappop(self._heap)
            entry = self._entries.get(block_hash)
            if entry is not None and entry.tick == tick:
                break  # the live item; older ones for the same entry are stale
        del self._entries[block_hash]
        self._free_slots.append(entry.slot)
        self._clock = priority  # GDSF aging: later entries start above what was just evicted
        self.num_evictions += 1


def _check(condition: bool, message: str) -> None:
    # Not `assert`: tests call the checks and must not lose them under `python -O`.
    if not condition:
        raise AssertionError(message)
