"""Prefix cache: blocks are shared by content + prefix + namespace only, evicted LRU, hits counted."""

from __future__ import annotations

import pytest

from generation.engine.block_manager import BlockManager
from generation.engine.prefix_cache import PrefixCache, hash_block
from generation.engine.sequence import Sequence

BS = 4


def computed(bm: BlockManager, tokens: list[int], namespace: str | None = None) -> Sequence:
    """A sequence allocated and prefilled in full, its full blocks published."""
    seq = Sequence(tokens, max_tokens=8, namespace=namespace)
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    return seq


def test_hash_depends_on_namespace_parent_and_tokens() -> None:
    base = hash_block("lab-a", None, [1, 2, 3, 4])
    assert base == hash_block("lab-a", None, [1, 2, 3, 4])
    assert len(base) == 32
    others = {
        hash_block("lab-b", None, [1, 2, 3, 4]),
        hash_block(None, None, [1, 2, 3, 4]),
        hash_block("", None, [1, 2, 3, 4]),
        hash_block("lab-a", base, [1, 2, 3, 4]),
        hash_block("lab-a", None, [1, 2, 3, 5]),
        hash_block("lab-a", None, [4, 3, 2, 1]),
    }
    assert base not in others and len(others) == 6


def test_lookup_compares_content_not_only_the_hash() -> None:
    cache = PrefixCache()
    h = hash_block(None, None, [1, 2])
    assert cache.insert(7, h, None, None, [1, 2])
    assert cache.lookup(h, None, None, [1, 2]) == 7
    # A forged collision: same hash, other tokens / namespace / parent must all miss.
    assert cache.lookup(h, None, None, [1, 3]) is None
    assert cache.lookup(h, "tenant", None, [1, 2]) is None
    assert cache.lookup(h, None, b"x" * 32, [1, 2]) is None
    # A second block with the same content is not published over the first.
    assert not cache.insert(8, h, None, None, [1, 2])
    assert cache.lookup(h, None, None, [1, 2]) == 7 and not cache.is_cached(8)


def test_cache_evicts_least_recently_released_and_forgets_the_hash() -> None:
    cache = PrefixCache()
    hashes = {b: hash_block(None, None, [b]) for b in range(3)}
    for b, h in hashes.items():
        cache.insert(b, h, None, None, [b])
    for b in (2, 0, 1):
        cache.release(b)
    cache.acquire(0)  # hit again: no longer evictable
    assert cache.evictable_blocks() == [2, 1]
    assert cache.evict() == 2
    assert cache.lookup(hashes[2], None, None, [2]) is None
    assert cache.evict() == 1
    assert cache.evict() is None
    assert cache.lookup(hashes[0], None, None, [0]) == 0
    cache.check_invariants()


def test_blocks_are_shared_by_content_and_prefix() -> None:
    bm = BlockManager(16, BS)
    a = computed(bm, list(range(13)))  # blocks [0-3] [4-7] [8-11] [12]
    b = Sequence([*range(8), 99, 98, 97, 96, 95], max_tokens=8)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 1, 1]
    # The same tokens as a's second block, after another first block: a different prefix, no hit.
    c = Sequence([50, 51, 52, 53, 4, 5, 6, 7, 8], max_tokens=8)
    bm.allocate(c)
    assert c.num_cached_tokens == 0 and not set(c.block_table) & set(a.block_table)
    bm.check_invariants()


@pytest.mark.parametrize(("first", "second"), [("lab-a", "lab-b"), ("lab-a", None), (None, "lab-a"), ("", None)])
def test_no_sharing_across_namespaces(first: str | None, second: str | None) -> None:
    bm = BlockManager(16, BS)
    a = computed(bm, list(range(13)), namespace=first)
    other = Sequence(list(range(13)), max_tokens=8, namespace=second)
    bm.deallocate(a)  # even unreferenced cached blocks must not serve another namespace
    bm.allocate(other)
    assert other.num_cached_tokens == 0
    assert bm.num_hit_tokens == 0
    same = Sequence(list(range(13)), max_tokens=8, namespace=first)
    bm.allocate(same)
    assert same.num_cached_tokens == 12
    bm.check_invariants()


@pytest.mark.parametrize(("num_tokens", "expected_cached"), [(8, 4), (9, 8), (12, 8), (13, 12), (3, 0)])
def test_the_last_token_is_always_computed(num_tokens: int, expected_cached: int) -> None:
    bm = BlockManager(16, BS)
    computed(bm, list(range(16)))
    seq = Sequence(list(range(num_tokens)), max_tokens=8)
    assert bm.num_prefix_hit_tokens(seq) == expected_cached
    bm.allocate(seq)
    assert seq.num_cached_tokens == seq.num_computed_tokens == expected_cached
    assert seq.num_pending_tokens >= 1


def test_hit_counters() -> None:
    bm = BlockManager(16, BS)
    assert bm.hit_rate == 0.0
    computed(bm, list(range(10)))
    computed(bm, list(range(10)))  # hits 8 of 10
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (20, 8)
    assert bm.hit_rate == pytest.approx(0.4)


def test_blocks_filled_during_decode_are_published() -> None:
    bm = BlockManager(16, BS)
    a = computed(bm, [1, 2, 3])
    for token in (4, 5, 6):  # decode: each sampled token is computed the step after
        a.append_token(token)
        bm.may_append(a)
        a.num_computed_tokens = a.num_tokens
        bm.register_full_blocks(a)
    b = Sequence([1, 2, 3, 4, 5, 6], max_tokens=8)
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a.block_table[0]


def test_uncomputed_blocks_are_not_published() -> None:
    bm = BlockManager(16, BS)
    a = Sequence(list(range(12)), max_tokens=8)
    bm.allocate(a)
    a.num_computed_tokens = 5  # a prefill chunk: only the first block holds KV
    bm.register_full_blocks(a)
    assert bm.num_cached_blocks == 1
    b = Sequence(list(range(12)), max_tokens=8)
    bm.allocate(b)
    assert b.num_cached_tokens == 4
    bm.check_invariants()


def test_evictable_blocks_still_hit_and_leave_the_pool_on_hit() -> None:
    bm = BlockManager(3, BS)
    a = computed(bm, list(range(9)))  # 3 blocks, the first 2 published
    a_table = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    b = Sequence([*range(8), 42], max_tokens=8)
    assert bm.can_allocate(b)  # 2 evictable hits + 1 free block
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a_table[:2]
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    # The hits are referenced now, so a third copy needs only one new block, and there is none.
    c = Sequence([*range(8), 43], max_tokens=8)
    assert bm.num_prefix_hit_tokens(c) == 8 and not bm.can_allocate(c)
    bm.check_invariants()


def test_lru_eviction_takes_the_oldest_released_chain_tail_first() -> None:
    bm = BlockManager(6, BS)
    old = computed(bm, list(range(12)))  # 3 blocks, all published after a full prefill
    new = computed(bm, list(range(100, 112)))
    old_table = list(old.block_table)
    bm.deallocate(old)
    bm.deallocate(new)
    assert bm.num_cached_blocks == 6 and bm.num_free_blocks == 6
    # One new block evicts old's tail (its third block): old's first two blocks still hit.
    filler = Sequence([7, 7], max_tokens=8)
    bm.allocate(filler)
    assert filler.block_table == [old_table[2]]
    probe_old = Sequence(list(range(13)), max_tokens=8)
    probe_new = Sequence(list(range(100, 113)), max_tokens=8)
    assert bm.num_prefix_hit_tokens(probe_old) == 8
    assert bm.num_prefix_hit_tokens(probe_new) == 12
    bm.check_invariants()


def test_reset_drops_only_unreferenced_blocks() -> None:
    bm = BlockManager(8, BS)
    kept = computed(bm, list(range(9)))
    dropped = computed(bm, list(range(50, 59)))
    bm.deallocate(dropped)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_prefix_hit_tokens(Sequence(list(range(50, 59)), max_tokens=8)) == 0
    assert bm.num_prefix_hit_tokens(Sequence(list(range(9)), max_tokens=8)) == 8
    assert kept.block_table and bm.num_free_blocks == 5
    bm.check_invariants()


def test_disabled_prefix_cache_shares_nothing() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = computed(bm, list(range(13)))
    b = computed(bm, list(range(13)))
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_cached_blocks == 0 and bm.num_hit_tokens == 0
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 16 and bm.reset_prefix_cache() == 0
    bm.check_invariants()
