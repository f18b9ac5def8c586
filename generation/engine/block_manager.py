"""BlockManager: the paged KV block pool (reference counts, free list) over the prefix cache."""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

from generation.engine.prefix_cache import PrefixCache, hash_block
from generation.engine.sequence import Sequence

if TYPE_CHECKING:
    from generation.engine.chunk_reuse import ChunkReusePlan
    from generation.engine.host_kv_tier import HostKVTier


# Publish limit of a sequence whose blocks all hold its own exact KV.
_NO_LIMIT = 1 << 62


class BlockManager:
    """Hands out physical KV blocks to sequences and shares full blocks through the prefix cache.

    Every block is in exactly one state: free (no KV worth keeping), referenced by one or more
    block tables, or evictable (unreferenced but still cached and hit-able). New blocks come from
    the free list first, then by evicting the least recently released evictable block.

    Args:
        num_blocks: blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: share full blocks between sequences of the same namespaces: a block is
            shared only when its namespace key (every region covering it) and its whole prefix agree.
        host_tier: where evicted published blocks go and come back from (host_kv_tier.py); None
            (the default) drops them. Needs prefix caching.

    Raises:
        ValueError: num_blocks or block_size < 1.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, host_tier: HostKVTier | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        if host_tier is not None and self._cache is None:
            raise ValueError("a host KV tier keeps prefix-cache blocks: enable prefix caching")
        self.host_tier = host_tier
        # Sequences holding blocks, and how many of their leading blocks are published (or were hits).
        self._seqs: dict[int, Sequence] = {}
        self._num_published: dict[int, int] = {}
        # Leading blocks of a sequence that may ever be published: all of them, except for a
        # sequence with chunk KV copied in, whose blocks from the first filled one on are approximate.
        self._publish_limit: dict[int, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take: free ones plus evictable cached ones."""
        evictable = self._cache.num_evictable_blocks if self._cache is not None else 0
        return len(self._free) + evictable

    def scratch_blocks(self, n: int) -> list[int]:
        """Up to n free blocks that hold no cached KV (never used, or released unpublished).

        For measurements that write KV blocks outside any request (bench/rag_kv_reuse.py
        --copy-back): writing them disturbs no cached prefix, and no request holds them. They stay
        free; the next allocation may take them.
        """
        return list(self._free)[: max(0, n)]

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._cache.num_cached_blocks if self._cache is not None else 0

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Share of looked-up tokens whose KV came from the cache."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_prefix_hit_tokens(self, seq: Sequence) -> int:
        """Tokens that `allocate(seq)` would take from the cache right now (no side effects)."""
        return len(self.match(seq)) * self.block_size

    def num_restorable_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of seq's leading full blocks that the GPU cache or the host tier holds now (no side effects).

        What `restore_from_host` and then `match` would take: block by block under the exact key
        (namespace key, parent, tokens), a GPU hit or a host entry continues the run and the first
        block held by neither ends it; never the block holding seq's last token. Whether the pool
        has free blocks for the copies back is not checked (a full pool may restore fewer).
        """
        host, cache = self.host_tier, self._cache
        if host is None or cache is None:
            return self.num_prefix_hit_tokens(seq)
        run = 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = (self._block_hash(seq, i), seq.block_namespace_key(i, self.block_size))
            parent = seq.block_hashes[i - 1] if i else None
            tokens = seq.block_tokens(i, self.block_size)
            if cache.lookup(*key, parent, tokens) is None and host.find(*key, parent, tokens) is None:
                break
            run += 1
        return run * self.block_size

    def match(self, seq: Sequence) -> list[int]:
        """Physical blocks of the longest cached run of seq's leading full blocks (no side effects).

        Valid until the pool changes; pass it to can_allocate and allocate to look up only once.
        """
        return self._match(seq)

    def can_allocate(self, seq: Sequence, hits: list[int] | None = None, plan: ChunkReusePlan | None = None) -> bool:
        hits = self._match(seq) if hits is None else hits
        return self._blocks_to_take(seq, hits, plan) <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: list[int] | None = None, plan: ChunkReusePlan | None = None) -> None:
        """Give seq blocks for all its current tokens, reusing the longest cached run of leading blocks.

        Sets `seq.num_cached_tokens` and `seq.num_computed_tokens` to the tokens served from the cache.
        `hits`: what `match(seq)` returned, if nothing changed the pool since.
        `plan`: chunk KV to copy into seq's own blocks (ChunkReusePlanner.plan); its source blocks
        are held (referenced) until `release_held`, after the copies ran.
        """
        assert seq.seq_id not in self._seqs and not seq.block_table, f"{seq} already holds blocks"
        hits = self._match(seq) if hits is None else hits
        assert self._blocks_to_take(seq, hits, plan) <= self.num_free_blocks, f"not enough free blocks for {seq}"
        # Take the hits (and the copies' sources) out of the evictable pool before taking new
        # blocks, so that eviction below cannot hand out a block this sequence is about to read.
        held = plan.held_blocks if plan is not None else []
        for block_id in [*hits, *held]:
            self._incref(block_id)
            if self._cache is not None:
                self._cache.record_hit(block_id)  # a reuse: the block's popularity for the host tier
        new_blocks = [self._take_block() for _ in range(seq.num_blocks(self.block_size) - len(hits))]
        seq.block_table = hits + new_blocks
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self._seqs[seq.seq_id] = seq
        self._num_published[seq.seq_id] = len(hits)
        self._publish_limit[seq.seq_id] = _NO_LIMIT
        if plan is not None and plan.filled_ranges:
            # Copies land only in blocks this sequence took just now (logical index >= hits).
            assert all(dst >= len(hits) for _, dst, _ in plan.copies)
            seq.held_blocks = list(held)
            seq.kv_copies = [(src, seq.block_table[dst], delta) for src, dst, delta in plan.copies]
            seq.filled_ranges = list(plan.filled_ranges)
            self._publish_limit[seq.seq_id] = plan.filled_ranges[0][0] // self.block_size
            seq.num_computed_tokens = seq.skip_filled(seq.num_computed_tokens)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_cached_tokens

    def release_held(self, seq: Sequence) -> None:
        """Drop seq's references to the blocks its copies read (the copies have run)."""
        held, seq.held_blocks, seq.kv_copies = seq.held_blocks, [], []
        # Last block first, as deallocate does: each chain's tail is evicted before its head.
        for block_id in reversed(held):
            self._decref(block_id)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks seq needs so that its table holds the first num_tokens tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's table to hold num_tokens tokens; False (and no change) if the pool is short."""
        assert seq.seq_id in self._seqs, f"{seq} holds no blocks: allocate it first"
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_id = self._take_block()
            seq.block_table.append(block_id)
        return True

    def can_append(self, seq: Sequence) -> bool:
        """Whether seq can get blocks for all its current tokens (the one a decode step writes)."""
        return self.blocks_needed(seq, seq.num_tokens) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Give seq blocks for all its current tokens; call after `can_append` said yes."""
        grown = self.ensure_capacity(seq, seq.num_tokens)
        assert grown, f"no free block for {seq}: check can_append first"

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's blocks that became full of computed KV, so later requests can hit them."""
        if self._cache is None:
            return
        start = self._num_published[seq.seq_id]
        # Never past the limit: blocks after copied-in KV hold an approximation, not this prefix's KV.
        end = min(seq.num_computed_tokens // self.block_size, self._publish_limit[seq.seq_id])
        for i in range(start, end):
            # insert() refuses a hash that another block already serves; this copy stays private.
            self._cache.insert(
                seq.block_table[i],
                self._block_hash(seq, i),
                seq.block_namespace_key(i, self.block_size),
                seq.block_hashes[i - 1] if i else None,
                seq.block_tokens(i, self.block_size),
                seq.published_block_uses,
            )
        self._num_published[seq.seq_id] = max(start, end)

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's blocks; its KV is gone from its point of view (num_computed_tokens = 0)."""
        owner = self._seqs.pop(seq.seq_id, None)
        assert owner is seq, f"{seq} holds no blocks"
        del self._num_published[seq.seq_id]
        del self._publish_limit[seq.seq_id]
        self.release_held(seq)
        # Last block first: the LRU pool then evicts a chain's tail before its head, and a head
        # alone still serves hits while a tail without its head never can.
        for block_id in reversed(seq.block_table):
            self._decref(block_id)
        seq.block_table = []
        seq.filled_ranges = []  # the copies went with the blocks; a readmission plans again
        seq.num_computed_tokens = 0

    def _decref(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        assert self._ref_counts[block_id] >= 0
        if self._ref_counts[block_id] == 0:
            if self._cache is not None and self._cache.is_cached(block_id):
                self._cache.release(block_id)
            else:
                self._free.append(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence references; returns how many were dropped.

        Blocks in use keep their entries: their KV is still valid for the sequences using them.
        """
        if self._cache is None:
            return 0
        dropped = self._cache.clear_evictable()
        self._free.extend(dropped)
        if self.host_tier is not None:
            self.host_tier.clear()  # a reset means cold: nothing comes back from the host either
        return len(dropped)

    def restore_from_host(self, seq: Sequence) -> int:
        """Copy back from the host tier the blocks of seq's leading chain that the GPU misses; how many.

        Walks seq's full blocks (not the one holding its last token, as `match`) in order: a GPU
        hit is kept, a miss that the host tier holds under the exact same key is copied into a new
        block and published as if computed, and the first block missing from both ends the walk.
        The restored blocks are left cached and unreferenced, so that `match` and `allocate` then
        take them like any other hit. Needs a free or evictable block per copy; stops without one.
        """
        host, cache = self.host_tier, self._cache
        if host is None or cache is None:
            return 0
        held: list[int] = []  # the chain so far, referenced so that taking blocks cannot evict it
        restored = 0
        try:
            for i in range((seq.num_tokens - 1) // self.block_size):
                key = (self._block_hash(seq, i), seq.block_namespace_key(i, self.block_size))
                parent = seq.block_hashes[i - 1] if i else None
                tokens = seq.block_tokens(i, self.block_size)
                block_id = cache.lookup(*key, parent, tokens)
                if block_id is None:
                    if host.find(*key, parent, tokens) is None or self.num_free_blocks == 0:
                        break
                    block_id = self._take_block()
                    # Taking the block may have evicted one to the host and, to make room there,
                    # this very entry: look it up again after the take, never before.
                    slot = host.find(*key, parent, tokens)
                    if slot is None or not cache.insert(block_id, *key, parent, tokens):
                        self._ref_counts[block_id] = 0
                        self._free.append(block_id)
                        break
                    host.restore(slot, key[0], block_id)
                    restored += 1
                else:
                    self._incref(block_id)
                held.append(block_id)
        finally:
            if restored:
                host.end_restore()
            # Last block first, as deallocate does: the chain's tail is evicted before its head.
            for block_id in reversed(held):
                self._decref(block_id)
        return restored

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (for tests)."""
        cache = self._cache
        references = Counter(b for seq in self._seqs.values() for b in seq.block_table + seq.held_blocks)
        free = set(self._free)
        evictable = set(cache.evictable_blocks()) if cache is not None else set()
        _check(len(free) == len(self._free), "a block is on the free list twice")
        _check(not free & evictable, f"blocks both free and evictable: {sorted(free & evictable)}")
        for block_id in range(self.num_blocks):
            refs = self._ref_counts[block_id]
            _check(refs == references[block_id], f"block {block_id} has ref {refs}, {references[block_id]} tables")
            in_pools = (block_id in free) + (block_id in evictable)
            _check(in_pools == (refs == 0), f"block {block_id} (ref {refs}) is in {in_pools} pools")
            _check(not (block_id in free and cache is not None and cache.is_cached(block_id)), "free block cached")
        for seq_id, seq in self._seqs.items():
            _check(seq.seq_id == seq_id, f"{seq} filed under id {seq_id}")
            _check(len(seq.block_table) * self.block_size >= seq.num_computed_tokens, f"{seq} computed past its table")
            _check(len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice")
            # Copies write only the sequence's own private blocks, never a shared or cached one.
            for _, dst, _ in seq.kv_copies:
                _check(self._ref_counts[dst] == 1, f"{seq} copies into block {dst}, which others reference")
                _check(cache is None or not cache.is_cached(dst), f"{seq} copies into cached block {dst}")
        if cache is None:
            return
        cache.check_invariants()
        if self.host_tier is not None:
            self.host_tier.check_invariants()
        for seq in self._seqs.values():
            for i in range(self._num_published[seq.seq_id]):
                entry = cache.entry(seq.block_table[i])
                if entry is not None:
                    # A shared block must hold exactly this sequence's tokens, prefix and namespace.
                    _check(entry.block_hash == seq.block_hashes[i], f"{seq} block {i} is cached under another hash")
                    key = seq.block_namespace_key(i, self.block_size)
                    _check(entry.namespace == key, f"{seq} shares block {i} across namespaces")
                    _check(
                        entry.parent_hash == (seq.block_hashes[i - 1] if i else None),
                        f"{seq} shares block {i} under another prefix",
                    )
                    _check(entry.token_ids == tuple(seq.block_tokens(i, self.block_size)), f"{seq} block {i} tokens")
            for i in range(self._num_published[seq.seq_id], len(seq.block_table)):
                _check(not cache.is_cached(seq.block_table[i]), f"{seq} block {i} is cached before it is computed")

    def _match(self, seq: Sequence) -> list[int]:
        """Physical blocks of the longest cached run of seq's leading full blocks."""
        if self._cache is None:
            return []
        # At least one token must be computed to produce logits, so the block holding the last
        # token is never taken from the cache, even when it is full and cached.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self._cache.lookup(
                self._block_hash(seq, i),
                seq.block_namespace_key(i, self.block_size),
                seq.block_hashes[i - 1] if i else None,
                seq.block_tokens(i, self.block_size),
            )
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _blocks_to_take(self, seq: Sequence, hits: list[int], plan: ChunkReusePlan | None = None) -> int:
        # Hits (and held copy sources) that sit in the evictable pool are counted in
        # num_free_blocks, so they use up free capacity just like new blocks; blocks already
        # referenced cost nothing.
        read = set(hits) | set(plan.held_blocks if plan is not None else ())
        evictable_reads = sum(1 for b in read if self._ref_counts[b] == 0)
        return seq.num_blocks(self.block_size) - len(hits) + evictable_reads

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of seq's first num_blocks full blocks (kept in seq.block_hashes)."""
        if num_blocks > 0:
            self._block_hash(seq, num_blocks - 1)
        return seq.block_hashes[:num_blocks]

    def _block_hash(self, seq: Sequence, i: int) -> bytes:
        hashes = seq.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            tokens = seq.block_tokens(j, self.block_size)
            assert len(tokens) == self.block_size, "only full blocks have a hash"
            key = seq.block_namespace_key(j, self.block_size)
            hashes.append(hash_block(key, hashes[j - 1] if j else None, tokens))
        return hashes[i]

    def _incref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            assert self._cache is not None
            self._cache.acquire(block_id)
        self._ref_counts[block_id] += 1

    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            evicted = self._cache.evict_entry() if self._cache is not None else None
            assert evicted is not None, "no free or evictable block"
            entry, uses = evicted
            block_id = entry.block_id
            if self.host_tier is not None:
                # Its KV is intact until the caller writes the block: keep a host copy first.
                host = self.host_tier
                host.save(block_id, entry.block_hash, entry.namespace, entry.parent_hash, entry.token_ids, uses)
        assert self._ref_counts[block_id] == 0
        self._ref_counts[block_id] = 1
        return block_id


def _check(condition: bool, message: str) -> None:
    # Not `assert`: tests call check_invariants and must not lose it under `python -O`.
    if not condition:
        raise AssertionError(message)
