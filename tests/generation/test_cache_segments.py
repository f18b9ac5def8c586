"""Prefix-cache namespaces per prompt segment: block keys, sharing and isolation by hit counters, batching.

Layout of the engine tests (block size 4): [system: 8 tokens][source: 10 tokens][question: 10 tokens].
The question region starts at token 18, inside block 4 (tokens 16..19), so blocks 0..3 (16 tokens)
are system + source only and block 4 is keyed by both the source and the user namespace.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import struct

import pytest

from generation import SamplingParams
from generation.config import EngineConfig
from generation.engine.async_engine import AsyncLLMEngine
from generation.engine.block_manager import BlockManager
from generation.engine.cache_namespaces import CacheNamespaces
from generation.engine.llm_engine import LLMEngine
from generation.engine.prefix_cache import PrefixCache, hash_block
from generation.engine.sequence import Sequence
from rag.errors import GenerationError

BS = 4
SYSTEM = [5, 6, 7, 8, 9, 10, 11, 12]
SOURCE = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
QUESTION = [70, 71, 72, 73, 74, 75, 76, 77, 78, 79]
OTHER_QUESTION = [90, 91, 92, 93, 94, 95, 96, 97, 98, 99]
QUESTION_AT = len(SYSTEM) + len(SOURCE)  # 18: inside block 4
SHARED_TOKENS = QUESTION_AT // BS * BS  # 16: the full blocks before the first one the user region touches


def regions(source_ns: str, user_ns: str) -> list[tuple[int, str | None]]:
    return [(0, "sys"), (len(SYSTEM), source_ns), (QUESTION_AT, user_ns)]


# -------------------------------------------------------------------------------------------------
# Region normalization and block keys (no torch)
# -------------------------------------------------------------------------------------------------


def test_block_key_binds_every_region_covering_the_block() -> None:
    ns = CacheNamespaces.of([(0, "s"), (6, "u")], 20)
    assert [ns.block_key(i, BS) for i in range(4)] == ["s", ((0, "s"), (2, "u")), "u", "u"]
    # Two transitions inside one block, each at its block-relative offset.
    many = CacheNamespaces.of([(0, "a"), (5, "b"), (6, None)], 12)
    assert many.block_key(1, BS) == ((0, "a"), (1, "b"), (2, None))
    # A transition on a block's first token: the block lies wholly in the new region.
    aligned = CacheNamespaces.of([(0, "a"), (4, "b")], 12)
    assert [aligned.block_key(i, BS) for i in range(3)] == ["a", "b", "b"]
    # Generated tokens (past the 12-token prompt) belong to the last region.
    assert aligned.block_key(10, BS) == "b" and aligned.namespace_at(1000) == "b"


def test_regions_normalize_to_the_namespace_of_each_token() -> None:
    # One region, or neighbours with the same namespace, are the plain namespace.
    assert CacheNamespaces.of([(0, "a")], 5) == CacheNamespaces.of("a", 5)
    merged = CacheNamespaces.of([(0, "a"), (2, "a"), (3, "b"), (4, "b")], 8)
    assert merged.spec == ((0, "a"), (3, "b"))
    assert CacheNamespaces.of(None, 3).spec is None
    assert Sequence(range(8), max_tokens=2, namespace=[(0, "a"), (2, "a")]).namespace == "a"


def _reference_hash(namespace: str | None, parent: bytes | None, tokens: list[int]) -> bytes:
    # The encoding of a plain namespace before regions existed: cached hashes must not move.
    h = hashlib.blake2b(digest_size=32)
    if namespace is None:
        h.update(b"\x00")
    else:
        raw = namespace.encode()
        h.update(b"\x01" + struct.pack("<Q", len(raw)) + raw)
    h.update(b"\x00" if parent is None else b"\x01" + parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def test_plain_namespaces_hash_as_before_and_region_keys_are_distinct() -> None:
    tokens = [1, 2, 3, 4]
    parent = b"p" * 32
    for ns in (None, "", "lab-a"):
        assert hash_block(ns, None, tokens) == _reference_hash(ns, None, tokens)
        assert hash_block(ns, parent, tokens) == _reference_hash(ns, parent, tokens)
    keys = [
        "s",
        "u",
        ((0, "s"), (2, "u")),
        ((0, "s"), (3, "u")),  # same namespaces, transition one token later
        ((0, "u"), (2, "s")),
        ((0, "s"), (2, None)),
        ((0, "s"), (2, "")),
        ((0, "s"), (1, "u"), (2, "u2")),
        ((0, "s\x00"), (2, "u")),
    ]
    hashes = {hash_block(k, None, tokens) for k in keys}
    assert len(hashes) == len(keys)


def test_lookup_compares_the_namespace_key_exactly() -> None:
    cache = PrefixCache()
    key = ((0, "s"), (2, "u"))
    h = hash_block(key, None, [1, 2, 3, 4])
    assert cache.insert(3, h, key, None, [1, 2, 3, 4])
    assert cache.lookup(h, key, None, [1, 2, 3, 4]) == 3
    # A forged collision: same hash and tokens, another key (or only one of its namespaces) misses.
    for other in ("s", "u", ((0, "s"), (3, "u")), ((0, "s"), (2, "v"))):
        assert cache.lookup(h, other, None, [1, 2, 3, 4]) is None


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([], "empty"),
        ([(1, "a")], "offset 0"),
        ([(0, "a"), (0, "b")], "strictly increase"),
        ([(0, "a"), (5, "b"), (3, "c")], "strictly increase"),
        ([(0, "a"), (8, "b")], "prompt has 8 tokens"),
        ([(0, 5)], "string or None"),
        ([(0, "a", "b")], "pair"),
        ([(True, "a")], "must be an int"),
        ([(0.0, "a")], "must be an int"),
        (b"ns", "sequence of"),
        (7, "sequence of"),
    ],
)
def test_bad_regions_are_rejected(bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sequence(range(8), max_tokens=2, namespace=bad)


# -------------------------------------------------------------------------------------------------
# BlockManager
# -------------------------------------------------------------------------------------------------


def computed(bm: BlockManager, tokens: list[int], namespace) -> Sequence:
    """A sequence allocated and prefilled in full, its full blocks published."""
    seq = Sequence(tokens, max_tokens=8, namespace=namespace)
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    bm.check_invariants()
    return seq


def hits(bm: BlockManager, tokens: list[int], namespace) -> int:
    """Tokens a new sequence takes from the cache, counted by the block manager's hit counter."""
    before = bm.num_hit_tokens
    seq = computed(bm, tokens, namespace)
    bm.deallocate(seq)
    bm.check_invariants()
    return bm.num_hit_tokens - before


def test_a_straddling_block_is_shared_only_when_both_namespaces_agree() -> None:
    bm = BlockManager(32, BS)
    tokens = list(range(13))  # blocks 0..2 full; block 1 holds tokens 4..7, the boundary at 6
    first = computed(bm, tokens, [(0, "s"), (6, "u1")])
    entry = bm._cache.entry(first.block_table[1])
    assert entry is not None and entry.namespace == ((0, "s"), (2, "u1"))
    bm.deallocate(first)
    assert hits(bm, tokens, [(0, "s"), (6, "u2")]) == 4  # other user: block 0 only
    assert hits(bm, tokens, [(0, "s"), (5, "u1")]) == 4  # same user, boundary one token earlier
    assert hits(bm, tokens, "s") == 4  # block 1 is not the plain "s" block
    assert hits(bm, tokens, [(0, "s"), (6, "u1")]) == 12  # same regions: every full block but the last token's


def test_a_user_region_makes_every_later_block_private() -> None:
    bm = BlockManager(32, BS)
    tokens = list(range(17))
    # Blocks 2 and 3 have the same key ("s") and tokens in both, but their chains run through
    # another user's block 1, so their hashes differ and they can never serve each other.
    ana = computed(bm, tokens, [(0, "s"), (4, "u1"), (8, "s")])
    bob = computed(bm, tokens, [(0, "s"), (4, "u2"), (8, "s")])
    assert bob.num_cached_tokens == 4
    assert [ana.block_namespace_key(i, BS) for i in (2, 3)] == [bob.block_namespace_key(i, BS) for i in (2, 3)]
    assert ana.block_hashes[0] == bob.block_hashes[0]
    assert all(ana.block_hashes[i] != bob.block_hashes[i] for i in (1, 2, 3))
    bm.deallocate(ana)
    bm.deallocate(bob)
    assert hits(bm, tokens, [(0, "s"), (4, "u1"), (8, "s")]) == 16


def test_generated_tokens_belong_to_the_last_region() -> None:
    bm = BlockManager(32, BS)
    turn = [(0, "s"), (6, "ana")]
    seq = Sequence(list(range(10)), max_tokens=8, namespace=turn)
    bm.allocate(seq)
    for token in range(100, 106):  # decode: tokens 10..15, filling blocks 2 and 3
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(token)
        bm.may_append(seq)
        bm.register_full_blocks(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    bm.check_invariants()
    history = list(seq.token_ids)
    bm.deallocate(seq)
    follow_up = [*history, 50, 51, 52]
    # Ana's next turn: history (prompt + answer) and the new question in her region.
    assert hits(bm, follow_up, [(0, "s"), (6, "ana")]) == 16
    # Marking the answer as a region of its own (same namespace) changes nothing ...
    assert hits(bm, follow_up, [(0, "s"), (6, "ana"), (10, "ana")]) == 16
    # ... but another user's turn over the same tokens shares only the system block.
    assert hits(bm, follow_up, [(0, "s"), (6, "bob")]) == 4


def _fingerprints(seq: Sequence) -> list[int]:
    """What a position's KV may be shared by: every token up to it and the namespace of each."""
    prints, h = [], 0
    for pos, token in enumerate(seq.token_ids):
        h = hash((h, seq.cache_namespaces.namespace_at(pos), token))
        prints.append(h)
    return prints


def test_random_regions_never_share_kv_across_namespaces() -> None:
    rng = random.Random(7)
    bm = BlockManager(24, BS)
    kv: dict[int, int] = {}  # slot -> fingerprint of the context its KV was computed in
    stems = [[rng.randrange(6) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.3:
            prompt = [*rng.choice(stems), *(rng.randrange(6) for _ in range(rng.randrange(0, 8)))][:30]
            cuts = sorted(rng.sample(range(1, len(prompt)), min(len(prompt) - 1, rng.randrange(0, 3))))
            spec = [(0, rng.choice(["s", None]))] + [(c, rng.choice(["a", "b", None])) for c in cuts]
            seq = Sequence(prompt, max_tokens=8, namespace=spec)
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live.append(seq)
        elif op < 0.85 and live:
            seq = rng.choice(live)
            if seq.num_pending_tokens > 0:
                end = seq.num_computed_tokens + rng.randint(1, seq.num_pending_tokens)
                prints = _fingerprints(seq)
                for pos, slot in enumerate(seq.slot_mapping(seq.num_computed_tokens, end, BS), seq.num_computed_tokens):
                    assert bm.ref_count(seq.block_table[pos // BS]) == 1, "wrote into a shared block"
                    kv[slot] = prints[pos]
                seq.num_computed_tokens = end
                bm.register_full_blocks(seq)
            elif seq.num_tokens < 40:
                seq.append_token(rng.randrange(6))
                if bm.can_append(seq):
                    bm.may_append(seq)
                else:
                    bm.deallocate(seq)
                    live.remove(seq)
        elif live:
            bm.deallocate(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
        for seq in live:
            prints = _fingerprints(seq)
            for pos, slot in enumerate(seq.slot_mapping(0, seq.num_computed_tokens, BS)):
                assert kv[slot] == prints[pos], f"{seq} position {pos} holds KV of another namespace or prefix"
    assert bm.num_hit_tokens > 0  # the run exercised sharing


# -------------------------------------------------------------------------------------------------
# LLMEngine with the tiny model
# -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    path, _ = tiny_model_factory("default")
    return path


def make_engine(model_dir, **overrides) -> LLMEngine:
    config = dict(device="cpu", block_size=BS, max_num_seqs=4, num_kv_blocks=96)
    return LLMEngine(model_dir, EngineConfig(**(config | overrides)))


PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def run(engine: LLMEngine, prompt: list[int], namespace) -> tuple[list[int], int]:
    """Generate one request to its end; returns its tokens and the prompt tokens it hit in the cache."""
    before = engine.get_metrics().prefix_cache_hit_tokens
    request_id = engine.add_request(prompt, PARAMS, namespace)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for update in engine.step():
            assert update.request_id == request_id
            tokens += update.new_token_ids
        engine.block_manager.check_invariants()
    return tokens, engine.get_metrics().prefix_cache_hit_tokens - before


def test_engine_shares_system_and_source_blocks_and_matches_the_uncached_output(model_dir) -> None:
    engine = make_engine(model_dir)
    uncached = make_engine(model_dir, enable_prefix_caching=False)
    prompts = [SYSTEM + SOURCE + QUESTION, SYSTEM + SOURCE + OTHER_QUESTION]
    users = ["user:ana", "user:bob"]
    expected = [run(uncached, p, regions("acl:lab-a", u))[0] for p, u in zip(prompts, users, strict=True)]

    first, first_hits = run(engine, prompts[0], regions("acl:lab-a", users[0]))
    second, second_hits = run(engine, prompts[1], regions("acl:lab-a", users[1]))
    assert first_hits == 0
    assert second_hits == SHARED_TOKENS == 16  # system + source blocks, not the straddling block 4
    assert [first, second] == expected
    assert uncached.get_metrics().prefix_cache_hit_tokens == 0


def test_engine_same_source_text_under_another_acl_shares_only_the_system(model_dir) -> None:
    engine = make_engine(model_dir)
    prompt = SYSTEM + SOURCE + QUESTION
    run(engine, prompt, regions("acl:lab-a", "user:ana"))
    _, other_acl_hits = run(engine, prompt, regions("acl:lab-b", "user:ana"))
    assert other_acl_hits == len(SYSTEM) == 8


def test_engine_never_shares_a_question_across_users(model_dir) -> None:
    engine = make_engine(model_dir)
    prompt = SYSTEM + SOURCE + QUESTION  # 28 tokens: at most blocks 0..5 can hit (last token computed)
    ana, _ = run(engine, prompt, regions("acl:lab-a", "user:ana"))
    bob, bob_hits = run(engine, prompt, regions("acl:lab-a", "user:bob"))
    assert bob_hits == SHARED_TOKENS  # stops at block 4, the first one the user region touches
    ana_again, ana_hits = run(engine, prompt, regions("acl:lab-a", "user:ana"))
    assert ana_hits == (len(prompt) - 1) // BS * BS == 24  # her own question blocks hit too
    assert ana == bob == ana_again  # same tokens, same greedy output: only the cache domain differs


def test_engine_plain_namespace_requests_behave_as_before(model_dir) -> None:
    engine = make_engine(model_dir)
    prompt = SYSTEM + SOURCE + QUESTION
    run(engine, prompt, "tenant")
    assert run(engine, prompt, "tenant")[1] == 24
    assert run(engine, prompt, [(0, "tenant")])[1] == 24  # one region is the plain namespace
    assert run(engine, prompt, None)[1] == 0


def test_engine_rejects_bad_regions(model_dir) -> None:
    engine = make_engine(model_dir)
    prompt = SYSTEM + SOURCE + QUESTION
    for bad in ([(2, "a")], [(0, "a"), (len(prompt), "b")], [(0, "a"), (9, "b"), (9, "c")]):
        with pytest.raises(GenerationError, match="namespace"):
            engine.make_request(prompt, PARAMS, bad)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(("num_requests", "max_num_seqs"), [(3, 4), (4, 2)])
def test_max_num_running_counts_requests_batched_together(model_dir, num_requests: int, max_num_seqs: int) -> None:
    engine = make_engine(model_dir, max_num_seqs=max_num_seqs)
    assert engine.get_metrics().max_num_running == 0
    for i in range(num_requests):
        engine.add_request(SYSTEM + SOURCE + [60 + i], PARAMS, regions("acl:lab-a", f"user:{i}"))
    while engine.has_unfinished_requests():
        engine.step()
        engine.block_manager.check_invariants()
    assert engine.get_metrics().max_num_running == min(num_requests, max_num_seqs)


def test_async_engine_takes_regions_and_rejects_bad_ones_in_the_caller(model_dir) -> None:
    served = AsyncLLMEngine(make_engine(model_dir))
    prompt = SYSTEM + SOURCE + QUESTION

    async def tokens(namespace) -> list[int]:
        return [t async for u in served.generate_updates(prompt, PARAMS, namespace) for t in u.new_token_ids]

    try:
        first = asyncio.run(tokens(regions("acl:lab-a", "user:ana")))
        second = asyncio.run(tokens(regions("acl:lab-a", "user:bob")))
        assert first == second and len(first) == PARAMS.max_tokens
        assert served.get_metrics().prefix_cache_hit_tokens == SHARED_TOKENS
        with pytest.raises(GenerationError, match="namespace"):
            asyncio.run(tokens([(1, "a")]))
    finally:
        served.shutdown()
