"""Block manager: allocation, growth, release, ref counts, and bookkeeping under random operations."""

from __future__ import annotations

import random

import pytest

from generation.engine.block_manager import BlockManager
from generation.engine.sequence import Sequence

BS = 4


def test_rejects_empty_pools_and_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, 0)


def test_sequence_block_helpers() -> None:
    seq = Sequence(range(10), max_tokens=4)
    assert (seq.num_tokens, seq.num_blocks(BS), seq.last_block_num_tokens(BS)) == (10, 3, 2)
    assert seq.block_tokens(1, BS) == [4, 5, 6, 7] and seq.block_tokens(2, BS) == [8, 9]
    seq.append_token(42)
    assert seq.output_token_ids == [42] and seq.num_output_tokens == 1
    seq.block_table = [5, 2, 9]
    assert seq.slot_mapping(3, 6, BS) == [23, 8, 9]
    with pytest.raises(ValueError, match="at least one token"):
        Sequence([], max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        Sequence([1], max_tokens=0)


def test_allocate_and_deallocate_account_for_every_block() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = Sequence(range(9), max_tokens=4)
    b = Sequence(range(4), max_tokens=4)
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert not set(a.block_table) & set(b.block_table)
    assert all(bm.ref_count(x) == 1 for x in a.block_table + b.block_table)
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (4, 4, 0.5)
    bm.check_invariants()
    released = list(a.block_table)
    a.num_computed_tokens = 9
    bm.deallocate(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert all(bm.ref_count(x) == 0 for x in released)
    assert bm.num_free_blocks == 7
    bm.check_invariants()
    with pytest.raises((AssertionError, KeyError)):  # KeyError under python -O
        bm.deallocate(a)
    assert bm.num_free_blocks == 7  # a double free changes nothing


def test_can_allocate_is_exact_at_the_pool_edge() -> None:
    bm = BlockManager(3, BS)
    fits = Sequence(range(12), max_tokens=4)
    too_big = Sequence(range(13), max_tokens=4)
    assert bm.can_allocate(fits) and not bm.can_allocate(too_big)
    bm.allocate(fits)
    assert not bm.can_allocate(Sequence([1], max_tokens=4))


def test_growth_takes_a_block_only_at_block_boundaries() -> None:
    bm = BlockManager(3, BS)
    seq = Sequence(range(3), max_tokens=16)
    bm.allocate(seq)
    grown_at = []
    for token in range(9):
        seq.append_token(token)
        before = len(seq.block_table)
        assert bm.can_append(seq)
        bm.may_append(seq)
        if len(seq.block_table) > before:
            grown_at.append(seq.num_tokens)
    assert grown_at == [5, 9]
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0
    seq.append_token(0)  # 13th token: no block left
    assert not bm.can_append(seq)
    assert not bm.ensure_capacity(seq, seq.num_tokens)
    assert len(seq.block_table) == 3  # a refused growth changes nothing
    bm.check_invariants()


def test_ensure_capacity_reserves_ahead_for_a_chunk() -> None:
    bm = BlockManager(8, BS)
    seq = Sequence([1], max_tokens=64)
    bm.allocate(seq)
    assert bm.blocks_needed(seq, 17) == 4
    assert bm.ensure_capacity(seq, 17)
    assert len(seq.block_table) == 5 and bm.num_free_blocks == 3
    assert not bm.ensure_capacity(seq, 40) and len(seq.block_table) == 5
    assert bm.ensure_capacity(seq, 3)  # already held: nothing to do
    bm.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    # The random test below leans on check_invariants; make sure it can fail.
    bm = BlockManager(4, BS)
    seq = Sequence(range(6), max_tokens=4)
    bm.allocate(seq)
    seq.block_table.append(seq.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants()
    seq.block_table.pop()
    bm.check_invariants()
    bm._free.append(seq.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants()


def _fingerprints(seq: Sequence) -> list[int]:
    """What the KV at each position depends on: the namespace and every token up to it."""
    prints, h = [], hash(("namespace", seq.namespace))
    for token in seq.token_ids:
        h = hash((h, token))
        prints.append(h)
    return prints


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_random_operations_keep_refcounts_and_kv_content_right(enable_prefix_caching: bool) -> None:
    rng = random.Random(1234)
    bm = BlockManager(24, BS, enable_prefix_caching=enable_prefix_caching)
    # A fake KV cache: slot -> fingerprint of the context the token at that slot was computed in.
    kv: dict[int, int] = {}
    stems = [[rng.randrange(20) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[Sequence] = []
    evictions = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.3:
            prompt = [*rng.choice(stems), *(rng.randrange(20) for _ in range(rng.randrange(0, 6)))]
            seq = Sequence(prompt[:40], max_tokens=8, namespace=rng.choice([None, "a", "b"]))
            if bm.can_allocate(seq):
                cached_before = bm.num_cached_blocks
                bm.allocate(seq)
                evictions += bm.num_cached_blocks < cached_before
                assert len(seq.block_table) == seq.num_blocks(BS)
                live.append(seq)
        elif op < 0.85 and live:
            seq = rng.choice(live)
            if seq.num_pending_tokens > 0:
                # A prefill chunk or decode step: write KV for the next tokens, only ever into
                # blocks this sequence owns alone.
                end = seq.num_computed_tokens + rng.randint(1, seq.num_pending_tokens)
                prints = _fingerprints(seq)
                for pos, slot in enumerate(seq.slot_mapping(seq.num_computed_tokens, end, BS), seq.num_computed_tokens):
                    assert bm.ref_count(seq.block_table[pos // BS]) == 1, "wrote into a shared block"
                    kv[slot] = prints[pos]
                seq.num_computed_tokens = end
                bm.register_full_blocks(seq)
            elif seq.num_tokens < 40:
                seq.append_token(rng.randrange(20))
                if bm.can_append(seq):
                    bm.may_append(seq)
                else:
                    bm.deallocate(seq)
                    live.remove(seq)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.deallocate(seq)
        bm.check_invariants()
        # Every computed position, whether computed here or taken from the cache, holds KV of
        # exactly this sequence's context in this namespace.
        for seq in live:
            prints = _fingerprints(seq)
            for pos, slot in enumerate(seq.slot_mapping(0, seq.num_computed_tokens, BS)):
                assert kv[slot] == prints[pos], f"{seq} position {pos} holds foreign KV"
    for seq in live:
        bm.deallocate(seq)
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 24
    if enable_prefix_caching:
        assert bm.num_hit_tokens > 0 and evictions > 0  # the run exercised sharing and eviction
    else:
        assert bm.num_hit_tokens == 0 and bm.num_cached_blocks == 0


def test_scratch_blocks_are_free_and_hold_no_cached_prefix() -> None:
    bm = BlockManager(6, BS)
    cached = Sequence(range(9), max_tokens=4)
    bm.allocate(cached)
    cached.num_computed_tokens = 9
    bm.register_full_blocks(cached)  # two full blocks published
    published = list(cached.block_table[:2])
    held = Sequence(range(100, 104), max_tokens=4)
    bm.allocate(held)
    bm.deallocate(cached)  # its published blocks stay cached (evictable), the partial one is free
    scratch = bm.scratch_blocks(10)
    assert scratch and not set(scratch) & (set(published) | set(held.block_table))
    assert all(bm.ref_count(b) == 0 for b in scratch)
    assert bm.scratch_blocks(1) == scratch[:1] and bm.scratch_blocks(0) == []
    assert bm.num_prefix_hit_tokens(Sequence(range(9), max_tokens=4)) == 8  # nothing was disturbed
    bm.check_invariants()
