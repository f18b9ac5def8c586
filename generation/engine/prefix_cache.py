"""PrefixCache: full KV blocks published under a namespaced hash chain, with LRU eviction."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from generation.engine.cache_namespaces import NamespaceKey

HASH_SIZE = 32  # bytes of blake2b; wide enough that a collision is not a practical concern


def hash_block(namespace: NamespaceKey, parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block: its namespace key, the hash of the block before it and its token ids.

    Chaining the parent's hash makes equal hashes mean equal content *and* equal prefix, which is
    what makes the KV reusable (attention at every position depends on all earlier tokens).
    `namespace` is a block's key (`CacheNamespaces.block_key`): a plain namespace, or the
    `(offset in block, namespace)` regions of a block that a region boundary crosses.
    The encoding is unambiguous: None and "" namespaces differ, a region tuple differs from any
    plain namespace (its own tag, every part length-prefixed), and "no parent" from a parent.
    """
    h = hashlib.blake2b(digest_size=HASH_SIZE)
    if isinstance(namespace, tuple):
        h.update(b"\x02" + struct.pack("<Q", len(namespace)))
        for offset, region_namespace in namespace:
            h.update(struct.pack("<Q", offset) + _namespace_bytes(region_namespace))
    else:
        h.update(_namespace_bytes(namespace))
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash)
    # Little-endian int64 so the hash does not depend on the machine; the tokens run to the end.
    h.update(_int64s(len(token_ids)).pack(*token_ids))
    return h.digest()


def _namespace_bytes(namespace: str | None) -> bytes:
    # Tag 0 for None, tag 1 + length for a string: a plain namespace hashes as it always did.
    if namespace is None:
        return b"\x00"
    encoded = namespace.encode("utf-8")
    return b"\x01" + struct.pack("<Q", len(encoded)) + encoded


@functools.cache
def _int64s(n: int) -> struct.Struct:
    # A compiled format per block length: parsing the format string cost as much as the hash.
    return struct.Struct(f"<{n}q")


@dataclass(frozen=True, slots=True)

class CachedBlock:
    """What a published block holds, kept so that a hit is checked exactly, not trusted to the hash."""

    block_id: int
    block_hash: bytes
    namespace: NamespaceKey  # the block's namespace key, not only the request's first namespace
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


class PrefixCache:
    """Maps block hashes to physical blocks, and keeps unreferenced cached blocks in an LRU pool.

    The block manager owns reference counts; this class only learns when a cached block stops
    being referenced (`release`) or is referenced again (`acquire`). A released block keeps its
    KV and stays hit-able until `evict` hands it out for new content.
    """

    def __init__(self) -> None:
        self._by_hash: dict[bytes, CachedBlock] = {}
        self._by_block: dict[int, CachedBlock] = {}
        # Cached blocks with no reference, oldest release first (the next to evict).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Hits on each cached block since it was published: its popularity for the host tier.
        self._num_hits: dict[int, int] = {}

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def lookup(
        self, block_hash: bytes, namespace: NamespaceKey, parent_hash: bytes | None, token_ids: Sequence[int]
    ) -> int | None:
        """The physical block holding exactly this block (same namespace key, parent, tokens), or None."""
        entry = self._by_hash.get(block_hash)
        if entry is None:
            return None
        return entry.block_id if is_same_block(entry, namespace, parent_hash, token_ids) else None

    def insert(
        self,
        block_id: int,
        block_hash: bytes,
        namespace: NamespaceKey,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        uses: int = 0,
    ) -> bool:
        """Publish a referenced block whose KV is computed; False if the hash already has a block.

        A duplicate (two requests computed the same block at once) stays private and is freed
        normally: the first published copy serves later hits. `uses`: demand already known for
        the block (a chunk compile's), counted like hits for the host tier.
        """
        assert block_id not in self._by_block, f"block {block_id} is already cached"
        if block_hash in self._by_hash:
            return False
        entry = CachedBlock(block_id, block_hash, namespace, parent_hash, tuple(token_ids))
        self._by_hash[block_hash] = entry
        self._by_block[block_id] = entry
        if uses:
            self._num_hits[block_id] = uses
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._by_block

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def entry(self, block_id: int) -> CachedBlock | None:
        return self._by_block.get(block_id)

    def release(self, block_id: int) -> None:
        """A cached block lost its last reference: it becomes the most recently used evictable one."""
        assert block_id in self._by_block and block_id not in self._evictable
        self._evictable[block_id] = None

    def acquire(self, block_id: int) -> None:
        """An evictable block was hit: it is referenced again and must not be evicted."""
        del self._evictable[block_id]

    def evict(self) -> int | None:
        """Drop the least recently released block's entry and return its id (None if none)."""
        evicted = self.evict_entry()
        return evicted[0].block_id if evicted is not None else None

    def evict_entry(self) -> tuple[CachedBlock, int] | None:
        """Drop the least recently released block's entry; returns it and its hits (None if none)."""
        if not self._evictable:
            return None
        block_id, _ = self._evictable.popitem(last=False)
        entry, hits = self._by_block[block_id], self._num_hits.get(block_id, 0)
        self._drop(block_id)
        return entry, hits

    def record_hit(self, block_id: int) -> None:
        """A request reused this cached block (counted for the host tier's priority)."""
        self._num_hits[block_id] = self._num_hits.get(block_id, 0) + 1

    def clear_evictable(self) -> list[int]:
        """Drop every unreferenced block's entry; returns their ids for the free list."""
        block_ids = list(self._evictable)
        self._evictable.clear()
        for block_id in block_ids:
            self._drop(block_id)
        return block_ids

    def cached_blocks(self) -> list[CachedBlock]:
        return list(self._by_block.values())

    def evictable_blocks(self) -> list[int]:
        """Evictable block ids, next to evict first."""
        return list(self._evictable)

    def check_invariants(self) -> None:
        """Raise AssertionError if the two maps or the LRU pool disagree."""
        _check(len(self._by_hash) == len(self._by_block), "hash map and block map differ in size")
        for block_hash, entry in self._by_hash.items():
            _check(entry.block_hash == block_hash, f"block {entry.block_id} is filed under another hash")
            _check(self._by_block.get(entry.block_id) is entry, f"block {entry.block_id} missing from block map")
        for block_id in self._evictable:
            _check(block_id in self._by_block, f"evictable block {block_id} is not cached")

    def _drop(self, block_id: int) -> None:
        self._num_hits.pop(block_id, None)
        entry = self._by_block.pop(block_id)
        del self._by_hash[entry.block_hash]


def _check(condition: bool, message: str) -> None:
    # Not `assert`: tests call the checks and must not lose them under `python -O`.
    if not condition:
        raise AssertionError(message)


def is_same_block(entry, namespace: NamespaceKey, parent_hash: bytes | None, token_ids: Sequence[int]) -> bool:
    """Whether a cached entry (GPU or host tier) is exactly this block.

    Namespaces are a security boundary: compare the whole key (every region covering the block)
    and the content exactly, never only through the hash.
    """
    return (entry.namespace == namespace and entry.parent_hash == parent_hash
            and entry.token_ids == tuple(token_ids))
