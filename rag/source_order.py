"""The order of the retrieved sources in a prompt: the longest cached prefix first, ties by rank.

The engine's prefix cache reuses KV only for a prompt's leading blocks that an earlier prompt
computed under the same namespaces, so which source comes first decides how much is reused.
With a generator that can say what is cached (`PrefixCacheProbe`, the local engine), the order
is built greedily: at each position, the source whose placement there gives the longest cached
prefix (the sources not yet placed following in rank order), the better-ranked on a tie; once
the chosen source is not wholly cached nothing after it can be, and the rest keep their rank
order. A cold cache costs one read-only probe per source; each wholly cached position one more
round.

Without cache information (a remote OpenAI server, whose cache we cannot see) the sources go
in the (document, chunk) sort: requests whose sources overlap then share leading sources whatever
their ranks were. On the sample questions (`bench/rag_source_order.py`, an exact-prefix cache
simulated over `examples/questions.jsonl`) it reused 8x the source tokens of rank order per user
(a remote server's `cache_salt = user`) and 1.6x shared across users (`cache_salt = off`):
rank order changes the first source whenever two users' rankings differ, the sort does not.

With an engine that reuses a chunk's KV at any position (`ChunkReuseProbe`, `kv_reuse="chunks"`),
cached chunks are reused wherever they land, so the order matters for the missed ones: the first
source is computed as its chunk's own reusable KV (the prompt's head, citation label [1] included,
is what every chunk's reusable KV follows), free of the compile a missed chunk elsewhere costs. The
engine names the source to lead with (a missed one that missed before, so likely to come
again); the rest keep their rank order. When it names none, the exact-prefix order above applies:
a cached chunk that leads is an exact prefix hit, with nothing copied or recomputed.

The order shown to the user follows the same order: citation [1] is the first source in the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from rag.generator import CachedPrefix, ChunkReuseProbe, GenerationRequest, Generator, PrefixCacheProbe
from rag.prompts import canonical_order

T = TypeVar("T")


def lead_with(items: Sequence[T], index: int) -> list[T]:
    """`items` with the one at `index` moved to the front, the others in their order."""
    return [items[index], *items[:index], *items[index + 1 :]]


def order_for_reuse(ranked: Sequence[T], cached: Callable[[list[T]], CachedPrefix]) -> list[T]:
    """`ranked` reordered so that the prompt's cached prefix is longest (greedy), ties by rank.

    Args:
        ranked: the sources, best first.
        cached: what of the prompt with the sources in a given order is cached (read-only).
    """
    if len(ranked) < 2:
        return list(ranked)
    order: list[T] = []
    rest = list(ranked)
    while rest:
        best: tuple[int, int, CachedPrefix] | None = None
        for i in range(len(rest)):
            prefix = cached([*order, rest[i], *rest[:i], *rest[i + 1 :]])
            if best is None or prefix.num_tokens > best[0]:
                best = (prefix.num_tokens, i, prefix)
        assert best is not None
        num_tokens, i, prefix = best
        order.append(rest.pop(i))
        position = len(order) - 1
        if position >= len(prefix.chunk_ends) or num_tokens < prefix.chunk_ends[position]:
            break  # the source just placed is not wholly cached: no later position can be
    return order + rest


def order_sources(ranked: Sequence[T], generator: Generator,
                  request_for: Callable[[list[T]], GenerationRequest]) -> list[T]:
    """The sources in the order to show and prompt them.

    Args:
        ranked: best first.
        generator: asked which source to lead with (ChunkReuseProbe) and what is cached
            (PrefixCacheProbe) when it can say; else the (document, chunk) sort.
        request_for: the generation request with the sources in a given order.
    """
    if isinstance(generator, ChunkReuseProbe) and len(ranked) > 1:
        lead = generator.source_to_lead(request_for(list(ranked)))
        if lead is not None:
            return lead_with(ranked, lead)
    if isinstance(generator, PrefixCacheProbe):
        return order_for_reuse(ranked, lambda order: generator.cached_prefix(request_for(order)))
    return canonical_order(ranked)
