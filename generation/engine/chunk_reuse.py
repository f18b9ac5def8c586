"""ChunkReusePlanner: fill a prompt's chunks from their canonical KV, and choose what is recomputed.

A chunk's canonical KV is the prefix-cache chain of `head ‖ chunk`, computed once standalone
after the shared head P (a "compile" request, `LLMEngine.add_segmented_request`). A later prompt
holding the chunk at start s copies those blocks into private blocks of its own, keys re-rotated
by delta = s - |P| (`layers/rerotation.py`), and the model recomputes the rest in position order
with the true causal mask: every label, each reused chunk's first block (or a leading fraction of
its tokens), anything that missed, and the suffix. That is KV-REUSE.md B2-B5, option B (private
re-rotated copies; no kernel changes).

Isolation comes from the prefix cache itself: the canonical chain is looked up under the chunk's
own namespace (its document's permission domain), the head's chain as parent and the exact token
ids, as every prefix-cache hit is. No new key is needed because canonical blocks are ordinary,
exact prefix-cache blocks. The approximate (blended) blocks are never published
(`BlockManager.allocate` caps publishing at the first filled range), so they can never be served
as exact hits, and canonical blocks are only ever read (the copies' sources, never in a
sequence's table).

Plain Python, no torch: the copies are carried out by the model runner before the step.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from generation.engine.prompt_segments import PromptSegment, SegmentKind, segment_starts
from generation.engine.sequence import Sequence

RECOMPUTE_CHOICES = ("first_block", "fraction")


@dataclass(frozen=True)
class ChunkRecompute:
    """Which tokens of a reused chunk the model recomputes in the new prompt.

    Args:
        mode: "first_block" (MEPIC/EPIC: the chunk's first KV block, which restores the attention
            sink at the chunk's start) or "fraction" (its leading ceil(fraction * length) tokens).
        fraction: for "fraction", in (0, 1]; 1 recomputes everything (equal to full prefill).

    Raises:
        ValueError: an unknown mode or a fraction out of range.
    """

    mode: str = "first_block"
    fraction: float = 0.15

    def __post_init__(self) -> None:
        if self.mode not in RECOMPUTE_CHOICES:
            raise ValueError(f"chunk recompute mode {self.mode!r} is not supported; valid: {RECOMPUTE_CHOICES}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"chunk recompute fraction must be in (0, 1], got {self.fraction}")

    def num_tokens(self, chunk_len: int, block_size: int) -> int:
        """Leading tokens of a chunk of chunk_len tokens that are recomputed (at least one)."""
        if self.mode == "first_block":
            return min(chunk_len, block_size)
        return max(1, min(chunk_len, math.ceil(self.fraction * chunk_len)))


@dataclass
class ChunkReusePlan:
    """What admission does for one segmented sequence: copies in, ranges filled, what was found."""

    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (source block, logical block, delta)
    filled_ranges: list[tuple[int, int]] = field(default_factory=list)
    # Distinct canonical blocks the plan reads or walks (copy sources and the recomputed leading
    # blocks before them), referenced until the copies ran.
    held_blocks: list[int] = field(default_factory=list)
    num_chunks_reused: int = 0
    # Chunks computed in place: not block-aligned, or their canonical KV was evicted since arrival.
    num_chunks_in_place: int = 0

    @property
    def num_filled_tokens(self) -> int:
        return sum(end - start for start, end in self.filled_ranges)


def compile_prompt(head: PromptSegment, chunk: PromptSegment) -> tuple[list[int], list[tuple[int, str | None]]]:
    """Token ids and namespace regions of a chunk's canonical sequence `head ‖ chunk`."""
    return [*head.token_ids, *chunk.token_ids], [(0, head.namespace), (len(head.token_ids), chunk.namespace)]


def _canonical_probe(head: PromptSegment, chunk: PromptSegment) -> Sequence:
    """A sequence whose leading chain is the chunk's canonical chain `head ‖ chunk`, every full block matchable."""
    ids, regions = compile_prompt(head, chunk)
    # One token more: the block holding a prompt's last token is never matched, and here
    # every full block of the chunk may be.
    return Sequence([*ids, 0], max_tokens=1, namespace=regions)


# Canonical chains whose block hashes are remembered (ChunkReusePlanner._probe). A request probes
# each of its chunks up to three times (the caller's ordering probe, the arrival lookup, the
# admission plan) and popular chunks come back across requests; each probe hashed every block of
# `head ‖ chunk` again (~38 blake2b calls for a 512-token chunk). An entry is a key of about
# 600 token ids plus 38 hashes, ~20 KB: the bound keeps them to ~10 MB.
CHAIN_HASH_ENTRIES = 512


class ChunkReusePlanner:
    """Plans chunk reuse over a block manager's prefix cache (lookups only; no side effects).

    Args:
        block_manager: the pool whose prefix cache holds the canonical chains.
        recompute: which tokens of a reused chunk are recomputed.
    """

    def __init__(self, block_manager, recompute: ChunkRecompute | None = None) -> None:  # noqa: ANN001 (cycle)
        self.block_manager = block_manager
        self.recompute = recompute or ChunkRecompute()
        # Lookups at a request's arrival: canonical KV found, or not (a compile was queued).
        self.num_chunk_hits = 0
        self.num_chunk_misses = 0
        # At admission: chunks filled from canonical KV, chunks computed in place, tokens filled.
        self.num_chunks_reused = 0
        self.num_chunks_in_place = 0
        self.num_reused_tokens = 0
        self._chain_hashes: OrderedDict[tuple[PromptSegment, PromptSegment], tuple[bytes, ...]] = OrderedDict()
        self._chain_lock = threading.Lock()  # is_cached may run on another thread than the stepping one

    def lookup(self, head: PromptSegment, chunk: PromptSegment) -> bool:
        """Whether every full block of the chunk's canonical KV is cached now (a chunk-cache hit or miss).

        A chunk whose leading blocks are cached but not its tail (an edited ending, an evicted
        tail) is a miss: its compile then recomputes only the missing blocks.
        """
        if self.block_manager.host_tier is not None and len(head.token_ids) % self.block_manager.block_size == 0:
            # Canonical blocks evicted to the host tier come back now: a hit, not a compile.
            self.block_manager.restore_from_host(self._probe(head, chunk))
        found = len(self.canonical_blocks(head, chunk)) >= self._full_blocks(chunk)
        if found:
            self.num_chunk_hits += 1
        else:
            self.num_chunk_misses += 1
        return found

    def is_cached(self, head: PromptSegment, chunk: PromptSegment) -> bool:
        """Whether `lookup` would find the chunk's canonical KV now, on the GPU or in the host tier (read-only).

        Nothing is counted, referenced or copied back, so a caller may probe before it orders
        a prompt's sources; another thread than the stepping one may call it (the answer can be
        stale by the time the request is added).
        """
        bs = self.block_manager.block_size
        head_len = len(head.token_ids)
        if head_len % bs:
            return False
        restorable = self.block_manager.num_restorable_prefix_tokens(self._probe(head, chunk))
        return restorable >= head_len + self._full_blocks(chunk) * bs

    def _probe(self, head: PromptSegment, chunk: PromptSegment) -> Sequence:
        """`_canonical_probe`, its block hashes taken from an earlier probe of the same chain when there was one.

        The hashes are a pure function of the key (the tokens and namespaces of head and chunk),
        and every probe gets its own list: the block manager appends to it.
        """
        seq = _canonical_probe(head, chunk)
        key = (head, chunk)  # frozen segments: equal tokens, namespace and kind
        with self._chain_lock:
            hashes = self._chain_hashes.get(key)
            if hashes is not None:
                self._chain_hashes.move_to_end(key)
        if hashes is None:
            # Every block a lookup may match (never the block of the probe's extra last token).
            hashes = tuple(self.block_manager.block_hashes(seq, (seq.num_tokens - 1) // self.block_manager.block_size))
            with self._chain_lock:
                self._chain_hashes[key] = hashes
                while len(self._chain_hashes) > CHAIN_HASH_ENTRIES:
                    self._chain_hashes.popitem(last=False)
        seq.block_hashes = list(hashes)
        return seq

    def _full_blocks(self, chunk: PromptSegment) -> int:
        """Canonical blocks a chunk needs cached to count as a hit (its full blocks, at least one)."""
        return max(1, len(chunk.token_ids) // self.block_manager.block_size)

    def canonical_blocks(self, head: PromptSegment, chunk: PromptSegment) -> list[int]:
        """Cached blocks of the chunk's canonical chain (its full blocks after the head), leading run only.

        Empty when the head is not block-aligned (the chunk's blocks would straddle head tokens).
        """
        bs = self.block_manager.block_size
        head_len = len(head.token_ids)
        if head_len % bs:
            return []
        hits = self.block_manager.match(self._probe(head, chunk))
        return hits[head_len // bs :]

    def restore_from_host(self, seq: Sequence) -> None:
        """Copy back from the host tier the canonical blocks of seq's chunks that the GPU misses."""
        assert seq.segments is not None
        head = seq.segments[0]
        if len(head.token_ids) % self.block_manager.block_size:
            return  # no chunk is reused after an unaligned head (canonical_blocks)
        for segment in seq.segments:
            if segment.kind is SegmentKind.CHUNK:
                self.block_manager.restore_from_host(self._probe(head, segment))

    def plan(self, seq: Sequence, num_hit_blocks: int) -> ChunkReusePlan:
        """Copies and filled ranges for seq, whose first num_hit_blocks blocks are exact prefix hits."""
        assert seq.segments is not None
        bs = self.block_manager.block_size
        segments = seq.segments
        head = segments[0]
        plan = ChunkReusePlan()
        exact_end = num_hit_blocks * bs
        for start, segment in zip(segment_starts(segments), segments, strict=True):
            if segment.kind is not SegmentKind.CHUNK or start + len(segment.token_ids) <= exact_end:
                continue  # not a chunk, or an exact prefix hit already (e.g. right after the head)
            canonical = self.canonical_blocks(head, segment) if start % bs == 0 else []
            # The last block holding the prompt's last token is always computed (it gives logits).
            usable = min(len(canonical), (seq.num_prompt_tokens - 1) // bs - start // bs)
            fill_start = max(start + self.recompute.num_tokens(len(segment.token_ids), bs), exact_end)
            fill_end = start + usable * bs
            if fill_end <= fill_start:
                plan.num_chunks_in_place += 1
                continue
            plan.num_chunks_reused += 1
            delta = start - len(head.token_ids)
            first_copied = (fill_start - start) // bs
            for j in range(first_copied, usable):
                plan.copies.append((canonical[j], start // bs + j, delta))
            # Held (and so refreshed in the eviction order and counted as hits) from the chain's
            # first block, not only the copied ones: the recomputed leading blocks are what every
            # lookup walks first, and evicting them would orphan the whole chunk however popular.
            plan.held_blocks.extend(canonical[:usable])
            plan.filled_ranges.append((fill_start, fill_end))
        plan.held_blocks = list(dict.fromkeys(plan.held_blocks))
        return plan

    def record(self, plan: ChunkReusePlan) -> None:
        """Count an admitted plan in the totals the metrics export."""
        self.num_chunks_reused += plan.num_chunks_reused
        self.num_chunks_in_place += plan.num_chunks_in_place
        self.num_reused_tokens += plan.num_filled_tokens
