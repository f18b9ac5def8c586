"""PromptSegment: a prompt given as a shared head, per-source labels and chunks, and a suffix.

A RAG prompt whose chunks' tokens depend only on the chunk (the `[n]` label is its own short
segment) can reuse a chunk's KV wherever the chunk lands (`chunk_reuse.py`). Each segment carries
its own prefix-cache namespace: the chunk's the document's permission domain, the label's and
suffix's the asking user's. The engine never tokenizes segments: the caller tokenizes each one on
its own, so that a chunk's ids are the same in every prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class SegmentKind(Enum):
    """What a segment is: the shared head P (system prompt), a source's label or chunk, the suffix."""

    HEAD = "head"
    LABEL = "label"
    CHUNK = "chunk"
    SUFFIX = "suffix"


@dataclass(frozen=True, slots=True)
class PromptSegment:
    """One segment: its kind, token ids and prefix-cache namespace (None is a namespace of its own)."""

    kind: SegmentKind
    token_ids: tuple[int, ...]
    namespace: str | None = None

    @classmethod
    def of(cls, kind: SegmentKind | str, token_ids: Sequence[int], namespace: str | None = None) -> PromptSegment:
        """Build a segment from a kind name ("head", "label", "chunk", "suffix") or kind.

        Raises:
            ValueError: an unknown kind, or a namespace that is not a string or None.
        """
        try:
            kind = SegmentKind(kind) if isinstance(kind, str) else kind
        except ValueError:
            valid = ", ".join(k.value for k in SegmentKind)
            raise ValueError(f"segment kind {kind!r} is not one of: {valid}") from None
        if namespace is not None and not isinstance(namespace, str):
            raise ValueError(f"a segment's namespace must be a string or None, got {namespace!r}")
        return cls(kind, tuple(int(t) for t in token_ids), namespace)


def check_segments(segments: Sequence[PromptSegment]) -> None:
    """Raise ValueError unless segments are one head, then labels and chunks, then one suffix, none empty."""
    if len(segments) < 2:
        raise ValueError("a segmented prompt needs at least a head and a suffix segment")
    if segments[0].kind is not SegmentKind.HEAD:
        raise ValueError(f"the first segment must be the head (system prompt), got {segments[0].kind.value!r}")
    if segments[-1].kind is not SegmentKind.SUFFIX:
        raise ValueError(f"the last segment must be the suffix (question), got {segments[-1].kind.value!r}")
    for i, segment in enumerate(segments):
        if not segment.token_ids:
            raise ValueError(f"segment {i} ({segment.kind.value}) has no tokens")
        if 0 < i < len(segments) - 1 and segment.kind not in (SegmentKind.LABEL, SegmentKind.CHUNK):
            raise ValueError(
                f"segment {i} is a {segment.kind.value!r}: only labels and chunks go between head and suffix"
            )


def segment_starts(segments: Sequence[PromptSegment]) -> list[int]:
    """Token offset of each segment in the concatenated prompt."""
    starts, offset = [], 0
    for segment in segments:
        starts.append(offset)
        offset += len(segment.token_ids)
    return starts


def prompt_token_ids(segments: Sequence[PromptSegment]) -> list[int]:
    """The concatenated prompt: each segment's ids, in order (what full prefill feeds)."""
    return [t for segment in segments for t in segment.token_ids]


def namespace_regions(segments: Sequence[PromptSegment]) -> list[tuple[int, str | None]]:
    """`(token_offset, namespace)` regions of the concatenated prompt, one per segment."""
    return [(start, s.namespace) for start, s in zip(segment_starts(segments), segments, strict=True)]
