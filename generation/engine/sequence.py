"""Sequence: the scheduler's and block manager's view of one request (tokens, KV blocks, progress)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from enum import Enum

from generation.engine.cache_namespaces import CacheNamespaces, NamespaceKey, NamespaceSpec
from generation.engine.prompt_segments import PromptSegment

# Process-wide ids: one engine may hold requests created by several callers.
_seq_ids = itertools.count()


class SequenceStatus(Enum):
    """Where a sequence is: queued for (re)admission, holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, KV block table and progress counters of one request; no torch, no text.

    Args:
        prompt_token_ids: the prompt, at least one token.
        max_tokens: most tokens to generate (>= 1); the scheduler finishes the sequence there.
        namespace: cache domain (tenant, permission domain) of the whole prompt, as a string or
            None (a namespace of its own); or `(token_offset, namespace)` regions
            (`cache_namespaces.NamespaceRegions`), the first at 0, offsets strictly increasing and
            inside the prompt, generated tokens in the last region. A KV block is shared only
            between sequences whose namespaces agree on every token of it and of all blocks before it.
        arrival_time: orders admission and preemption; `time.monotonic()` when not given.

    Raises:
        ValueError: empty prompt, max_tokens < 1, or malformed namespace regions.
    """

    def __init__(
        self,
        prompt_token_ids: Iterable[int],
        max_tokens: int,
        namespace: NamespaceSpec | CacheNamespaces = None,
        arrival_time: float | None = None,
    ) -> None:
        self.token_ids: list[int] = list(prompt_token_ids)
        if not self.token_ids:
            raise ValueError("a prompt needs at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.seq_id: int = next(_seq_ids)
        self.num_prompt_tokens: int = len(self.token_ids)
        self.max_tokens = max_tokens
        self.cache_namespaces = CacheNamespaces.of(namespace, self.num_prompt_tokens)
        # The plain namespace, or the normalized regions as a tuple (hashable, for fingerprints).
        self.namespace = self.cache_namespaces.spec
        self.arrival_time: float = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        # Set by the caller's stop logic (EOS, stop strings); the scheduler frees the sequence then.
        self.finished = False
        # Physical KV block ids; position p lives in slot block_table[p // block_size] * block_size + p % block_size.
        self.block_table: list[int] = []
        # Leading tokens whose KV is in the cache; the rest are fed to the model in later steps.
        self.num_computed_tokens = 0
        # Leading tokens whose KV came from the prefix cache at the last allocation.
        self.num_cached_tokens = 0
        # Uses each block this sequence publishes starts with, for the host tier's admission:
        # 1 for a chunk compile (requests retrieved its chunk: the one waiting for it, or two misses), else 0.
        self.published_block_uses = 0
        # Hash chain of the full blocks, filled lazily by the block manager. Tokens are append-only,
        # so the hashes stay valid across preemption and need computing once per sequence.
        self.block_hashes: list[bytes] = []
        # Chunk KV reuse (chunk_reuse.py): the prompt's segments when the engine may fill its
        # chunks from other prompts' KV; None for an ordinary request.
        self.segments: tuple[PromptSegment, ...] | None = None
        # Ranges [start, end) of positions whose KV was copied in (re-rotated), not computed, sorted;
        # the model is fed every other position. Set at allocation, cleared when the blocks go.
        self.filled_ranges: list[tuple[int, int]] = []
        # (source block, logical block index, delta) copies to run before the sequence's first step,
        # and the source blocks held (referenced) until then so that nothing evicts them first.
        self.kv_copies: list[tuple[int, int, int]] = []
        self.held_blocks: list[int] = []
        # Internal requests (chunk compiles) this one waits for before it is admitted.
        self.waits_for: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not computed yet: the rest of the prompt, or the last sampled token."""
        return len(self.token_ids) - self.num_computed_tokens

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold all current tokens."""
        return (len(self.token_ids) + block_size - 1) // block_size

    def last_block_num_tokens(self, block_size: int) -> int:
        """Tokens in the last (possibly partial) block, 1..block_size."""
        return len(self.token_ids) - (self.num_blocks(block_size) - 1) * block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        """Token ids of logical block i (shorter than block_size for a partial last block)."""
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def block_namespace_key(self, i: int, block_size: int) -> NamespaceKey:
        """Namespace key of logical block i: every namespace region covering one of its tokens."""
        return self.cache_namespaces.block_key(i, block_size)

    def run_end(self, start: int) -> int:
        """End of the computed run at `start`: the next filled range's start, or the last token."""
        for begin, _ in self.filled_ranges:
            if begin >= start:
                return begin
        return len(self.token_ids)

    def skip_filled(self, position: int) -> int:
        """`position`, moved past a filled range that begins there (its KV needs no computing)."""
        for begin, end in self.filled_ranges:
            if begin == position:
                return end
        return position

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def slot_mapping(self, start: int, end: int, block_size: int) -> list[int]:
        """KV cache slots (block_id * block_size + offset) of positions start..end-1."""
        table = self.block_table
        return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
