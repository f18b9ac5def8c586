"""CacheNamespaces: prefix-cache namespaces of a request by token offset, and the namespace key of each block.

A RAG prompt is laid out `[system][source 1]…[source k][history][question]`. Its sources may be
shared only among principals who can read them, and its history and question never across users,
so one namespace per request is too coarse. A request instead names regions: `(token_offset,
namespace)` transitions, the first at offset 0, each region running to the next one's offset and
the last one on through the generated tokens (the shape of vLLM PR #52655's `salt_regions`).

Each KV block is keyed by every region that covers one of its tokens: the namespace at its first
token plus any transition inside it, at its block-relative offset. A block's hash chains its
parent's, so once a per-user region starts, every later block of the sequence is user-specific.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

# What callers pass: one namespace for the whole request (None is a namespace of its own), or
# `(token_offset, namespace)` regions, the first at offset 0, offsets strictly increasing.
NamespaceRegions = Sequence[tuple[int, str | None]]
NamespaceSpec = str | None | NamespaceRegions

# What one block is keyed by. A block inside one region is keyed by that region's namespace
# (exactly as a single-namespace request, so its hashes are unchanged); a block that a transition
# crosses is keyed by `((0, namespace at its first token), (offset in block, next namespace), ...)`.
NamespaceKey = str | None | tuple[tuple[int, str | None], ...]


@dataclass(frozen=True, slots=True)
class CacheNamespaces:
    """The normalized namespace regions of one request.

    Build it with `CacheNamespaces.of`. `offsets[0] == 0`, offsets strictly increase, and no two
    neighbouring regions have the same namespace (they are merged), so that two requests whose
    tokens carry the same namespaces get the same block keys however the regions were written.
    """

    offsets: tuple[int, ...]
    namespaces: tuple[str | None, ...]

    @classmethod
    def of(cls, spec: NamespaceSpec | CacheNamespaces, num_prompt_tokens: int) -> CacheNamespaces:
        """Validate and normalize a namespace or regions for a prompt of num_prompt_tokens tokens.

        Raises:
            ValueError: regions that are empty, not `(int, str | None)` pairs, do not start at
                offset 0, do not strictly increase, or start at or past the prompt's end.
        """
        if isinstance(spec, CacheNamespaces):
            return spec
        if spec is None or isinstance(spec, str):
            return cls((0,), (spec,))
        if isinstance(spec, bytes | bytearray) or not isinstance(spec, Sequence):
            raise ValueError(
                f"a namespace must be a string, None, or a sequence of (token_offset, namespace) regions; "
                f"got {type(spec).__name__}"
            )
        if not spec:
            raise ValueError("namespace regions are empty: pass at least (0, namespace)")
        offsets: list[int] = []
        namespaces: list[str | None] = []
        previous = -1
        for region in spec:
            if not (isinstance(region, Sequence) and len(region) == 2):
                raise ValueError(f"a namespace region must be a (token_offset, namespace) pair, got {region!r}")
            offset, namespace = region
            if isinstance(offset, bool) or not isinstance(offset, int):
                raise ValueError(f"a region's token offset must be an int, got {offset!r}")
            if namespace is not None and not isinstance(namespace, str):
                raise ValueError(f"a region's namespace must be a string or None, got {namespace!r}")
            if not offsets and offset != 0:
                raise ValueError(f"the first namespace region must start at token offset 0, got {offset}")
            if offset <= previous:
                raise ValueError(f"namespace region offsets must strictly increase, got {offset} after {previous}")
            if offset >= num_prompt_tokens:
                raise ValueError(
                    f"a namespace region starts at token {offset} but the prompt has {num_prompt_tokens} tokens: "
                    "every region must start inside the prompt"
                )
            previous = offset
            if namespaces and namespaces[-1] == namespace:
                continue  # same namespace as the region before: one region
            offsets.append(offset)
            namespaces.append(namespace)
        return cls(tuple(offsets), tuple(namespaces))

    @property
    def is_single(self) -> bool:
        """One namespace for every token (a plain `str | None` request)."""
        return len(self.offsets) == 1

    @property
    def spec(self) -> NamespaceSpec:
        """The plain namespace when there is one, else the normalized regions (hashable)."""
        if self.is_single:
            return self.namespaces[0]
        return tuple(zip(self.offsets, self.namespaces, strict=True))

    def namespace_at(self, position: int) -> str | None:
        """Namespace of the token at position (generated tokens belong to the last region)."""
        return self.namespaces[bisect.bisect_right(self.offsets, position) - 1]

    def block_key(self, i: int, block_size: int) -> NamespaceKey:
        """Namespace key of logical block i: every region covering one of its tokens.

        The namespace itself when one region covers the whole block, else a tuple of
        `(offset in block, namespace)` starting with `(0, namespace at the block's first token)`.
        """
        if self.is_single:
            return self.namespaces[0]
        start = i * block_size
        first = bisect.bisect_right(self.offsets, start) - 1
        # Regions that begin inside the block, after its first token.
        end = bisect.bisect_left(self.offsets, start + block_size, lo=first + 1)
        if end == first + 1:
            return self.namespaces[first]
        key = [(0, self.namespaces[first])]
        key += [(self.offsets[r] - start, self.namespaces[r]) for r in range(first + 1, end)]
        return tuple(key)
