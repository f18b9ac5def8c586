"""ChunkDoorkeeper: compile a chunk's canonical KV only once it has missed more than once.

With `chunk_miss="in_place"` a request computes a missed chunk in its own prefill, so compiling
the chunk's canonical KV (`head ‖ chunk`, standalone) costs its tokens a second time. Under RAG
traffic most distinct chunks are cold: retrieved once in a long while (RAGCache's setting: 97% of
the chunks share 40% of the retrievals). Paying a compile for each of them would nearly double
their cost for KV that is evicted before anyone reuses it. A popular chunk misses again soon, so
the compile is queued from its second miss on, the doorkeeper of TinyLFU.

The doorkeeper remembers misses by a hash of the chunk's exact identity (its namespace, the
head's namespace and tokens, its own tokens), in a bounded LRU, so a namespace's chunk is only
ever counted under that namespace. A hash collision can only bring a compile forward (the compile
itself is keyed exactly, like every prefix-cache block), never serve anyone's KV.
"""

from __future__ import annotations

from collections import OrderedDict

from generation.engine.prompt_segments import PromptSegment

# Misses remembered: enough for the distinct chunks a busy service retrieves in minutes; an
# entry is one small int key, so this costs a few MiB at most.
DEFAULT_CAPACITY = 1 << 16


class ChunkDoorkeeper:
    """Counts chunk-cache misses and says when a chunk has missed often enough to compile.

    Args:
        misses_to_compile: a chunk is compiled at its n-th miss (>= 1; 1 compiles at once).
        capacity: most chunks remembered; the least recently missed is forgotten first.
    """

    def __init__(self, misses_to_compile: int = 2, capacity: int = DEFAULT_CAPACITY) -> None:
        if misses_to_compile < 1 or capacity < 1:
            raise ValueError(f"misses_to_compile and capacity must be >= 1, got {misses_to_compile}, {capacity}")
        self.misses_to_compile = misses_to_compile
        self.capacity = capacity
        self._misses: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._misses)

    def on_miss(self, head: PromptSegment, chunk: PromptSegment) -> bool:
        """Count one miss of `chunk` after `head`; True when its compile should be queued now."""
        key = self._key(head, chunk)
        count = self._misses.pop(key, 0) + 1
        if count >= self.misses_to_compile:
            return True  # forgotten: once compiled it hits, and if evicted it starts over
        self._misses[key] = count
        if len(self._misses) > self.capacity:
            self._misses.popitem(last=False)
        return False

    def has_missed(self, head: PromptSegment, chunk: PromptSegment) -> bool:
        """Whether `chunk` after `head` missed before and is remembered (read-only: nothing is counted)."""
        return self._key(head, chunk) in self._misses

    @staticmethod
    def _key(head: PromptSegment, chunk: PromptSegment) -> int:
        return hash((head.namespace, head.token_ids, chunk.namespace, chunk.token_ids))
