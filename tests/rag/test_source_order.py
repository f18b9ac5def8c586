"""Cache-aware source order: the longest cached prefix first, ties by rank; without cache info, sorted.

`order_for_reuse` alone runs over a stand-in probe (a trie of earlier orders); the rest runs the
real LocalGenerator, engine (tiny random Llama, CPU) and pipeline namespaces, counting work by the
engine's counters.
"""

from __future__ import annotations

import pytest

from permissions.models import Principal
from rag.generator import CachedPrefix, GenerationParams, GenerationRequest
from rag.generators.remote import RemoteGenerator
from rag.pipeline import Rag
from rag.prompts import build_prompt, citations_for
from rag.source_order import order_for_reuse, order_sources
from rag.types import Hit
from tests.rag import tiny_engine
from tests.rag.tiny_engine import generate, hit_tokens

# --- the greedy order over a stand-in cache -------------------------------------------------------

LENGTH = {"a": 30, "b": 20, "c": 40, "d": 10, "e": 20}  # tokens per source; the head is 16


class SeenOrders:
    """A prefix cache in miniature: the prompts (orders) seen before, cached whole."""

    def __init__(self, *orders: str) -> None:
        self.orders = orders
        self.probes = 0

    def __call__(self, order: list[str]) -> CachedPrefix:
        self.probes += 1
        ends, end = [], 16
        for s in order:
            end += LENGTH[s]
            ends.append(end)
        best = 16
        for seen in self.orders:
            n = 0
            while n < min(len(seen), len(order)) and seen[n] == order[n]:
                n += 1
            best = max(best, ends[n - 1] if n else 16)
        return CachedPrefix(best, tuple(ends))


def test_a_cold_cache_keeps_rank_order_after_one_probe_per_source():
    probe = SeenOrders()
    assert order_for_reuse(list("abcd"), probe) == list("abcd")
    assert probe.probes == 4


def test_the_cached_order_comes_first_and_the_rest_keep_their_rank():
    assert order_for_reuse(list("abcd"), SeenOrders("ca", "b")) == list("cabd")
    # The longer cached prefix wins: "ba" (20 + 30) beats "c" (40).
    assert order_for_reuse(list("abcd"), SeenOrders("ba", "c")) == list("bacd")


def test_ties_go_to_the_better_ranked_source():
    # "b" and "e" are both cached right after the head, and equally long.
    assert order_for_reuse(list("ebd"), SeenOrders("b", "e")) == list("ebd")
    assert order_for_reuse(list("bed"), SeenOrders("b", "e")) == list("bed")
    assert order_for_reuse(list("dbe"), SeenOrders("b", "e")) == list("bde")


def test_a_single_source_needs_no_probe():
    probe = SeenOrders("a")
    assert order_for_reuse(["a"], probe) == ["a"] and probe.probes == 0


def test_a_generator_that_cannot_see_its_cache_gets_the_document_chunk_sort():
    remote = RemoteGenerator("http://127.0.0.1:9/v1", model="m")
    b, a = hit("b.md", "beta"), hit("a.md", "alpha")
    assert order_sources([b, a], remote, lambda order: pytest.fail("no probe without cache info")) == [a, b]


# --- the real engine --------------------------------------------------------------------------------

BS = 8

# The tiny engine's fixtures, shared with the other tests of the service's prompt layout.
generator = tiny_engine.generator
model_dir = tiny_engine.model_dir
rag = tiny_engine.rag
ALICE = Principal("alice", frozenset({"genomics"}))
ERIN = Principal("erin", frozenset({"genomics"}))


def hit(key: str, text: str, score: float = 1.0) -> Hit:
    return Hit(chunk_id=sum(map(ord, key)), document_key=key, source=f"/d/{key}", chunk_index=0, text=text,
               score=score, title=key, acl=frozenset({"group:genomics"}))


A = hit("a.md", "Partition gpu holds nodes gpu01 to gpu08.", 3.0)
B = hit("b.md", "Scratch is purged after 30 days.", 2.0)
C = hit("c.md", "The genomics share is /data/genomics.", 1.0)


def requests_for(rag: Rag, principal: Principal, question: str):
    """What Rag.prepare builds for each order it considers."""

    def request_for(order: list[Hit]) -> GenerationRequest:
        prompt = build_prompt(question, order)
        return GenerationRequest(prompt.messages, GenerationParams(max_tokens=2),
                                 segments=rag.cache_segments(prompt, order, principal),
                                 user_salt=rag.user_salt(principal))

    return request_for


def test_sources_follow_the_cached_order_and_citations_follow_them(rag, generator):
    alice = requests_for(rag, ALICE, "Which GPU nodes can I use?")
    generate(generator, alice([C, A]))
    erin = requests_for(rag, ERIN, "Where is the share?")
    ranked = [A, B, C]
    order = order_sources(ranked, generator, erin)
    assert order == [C, A, B]
    assert [(c.number, c.document_key) for c in citations_for(order, ranked)] == [(1, "c.md"), (2, "a.md"),
                                                                                   (3, "b.md")]
    # The cached order reuses both of Alice's chunks; rank order would have reused the head only.
    rank_hits = generator.cached_prefix(erin(ranked)).num_tokens
    before = hit_tokens(generator)
    generate(generator, erin(order))
    reused = hit_tokens(generator) - before
    assert reused == generator.cached_prefix(alice([C, A])).chunk_ends[1] > rank_hits


def test_probing_changes_nothing_in_the_cache(rag, generator):
    alice = requests_for(rag, ALICE, "Which GPU nodes can I use?")
    generate(generator, alice([A, B]))
    engine = generator.engine.engine
    cache = engine.block_manager._cache
    state = (cache.evictable_blocks(), engine.block_manager.num_hit_tokens,
             engine.block_manager.num_queried_tokens, cache.num_cached_blocks)
    erin = requests_for(rag, ERIN, "Where is the share?")
    assert order_sources([B, A, C], generator, erin) == [A, B, C]
    assert (cache.evictable_blocks(), engine.block_manager.num_hit_tokens,
            engine.block_manager.num_queried_tokens, cache.num_cached_blocks) == state


def test_with_chunk_reuse_a_missed_source_leads_and_publishes_its_own_kv(rag, model_dir):
    """kv_reuse="chunks" (ChunkReuseProbe): cached chunks are reused wherever they land, so the
    source to lead with is a missed one that missed before: computed right after the head, it is
    its chunk's reusable KV, with no compile. Citations follow the order."""
    from tests.generation.test_chunk_reuse import compiles_of
    from tests.rag.tiny_engine import local_generator

    generator = local_generator(model_dir, block_size=BS, num_kv_blocks=512, kv_reuse="chunks")
    try:
        alice = requests_for(rag, ALICE, "Which GPU nodes can I use?")
        generate(generator, alice([A, B]))  # A leads and is published; B misses in place
        erin = requests_for(rag, ERIN, "Where is the share?")
        ranked = [A, C, B]
        order = order_sources(ranked, generator, erin)
        assert order == [B, A, C]  # B and C missed; B missed before, so it is likely to come again
        # No source missed before: the exact-prefix order (A's chain head || A is cached, so A first).
        assert order_sources([C, A], generator, erin) == [A, C]
        assert [(c.number, c.document_key) for c in citations_for(order, ranked)] == [(1, "b.md"), (2, "a.md"),
                                                                                       (3, "c.md")]
        compiles = compiles_of(generator.engine.engine)
        before = generator.metrics()
        generate(generator, erin(order))
        after = generator.metrics()
        assert after.chunk_cache_hits - before.chunk_cache_hits == 1  # A, at a new position
        assert compiles == []  # B publishes itself; C missed for the first time
        # B is now cached by Erin's own prefill; C, missed in place, still is not.
        assert generator.source_to_lead(erin([A, B])) is None
        assert order_sources([A, C, B], generator, erin) == [C, A, B]
    finally:
        generator.engine.shutdown()


def test_an_exact_only_engine_names_no_source_to_lead(rag, generator):
    assert generator.source_to_lead(requests_for(rag, ALICE, "Which GPU nodes can I use?")([A, B])) is None
