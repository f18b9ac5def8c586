"""Citation markers in answers: drop `[n]` that point at no source, and locate the ones that do.

Small models invent markers (`[4]` with three sources). A marker that points at no source is
removed from the text, while streaming too: a delta that ends inside what may become a marker is
held back until the marker is complete.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# [3] or [1, 2] or [1,2,3]
_MARKER = re.compile(r"\[(\d{1,3}(?:\s*,\s*\d{1,3})*)\]")
# What may still grow into a marker at the end of streamed text.
_OPEN_TAIL = re.compile(r"\[[\d,\s]{0,16}$")


def clean_markers(text: str, num_sources: int) -> str:
    """Text with every marker rewritten to its valid numbers, or removed if it has none."""

    def fix(match: re.Match[str]) -> str:
        numbers = [int(n) for n in match.group(1).split(",")]
        valid = [n for n in numbers if 1 <= n <= num_sources]
        return f"[{', '.join(str(n) for n in valid)}]" if valid else ""

    cleaned = _MARKER.sub(fix, text)
    if cleaned == text:
        return text
    # A removed marker leaves "word ." or double spaces behind.
    return re.sub(r"[ \t]+([.,;:!?])", r"\1", re.sub(r"[ \t]{2,}", " ", cleaned))


class MarkerFilter:
    """Streaming clean_markers: feed deltas, get text that is safe to show.

    Args:
        num_sources: markers 1..num_sources are kept.
    """

    def __init__(self, num_sources: int) -> None:
        self.num_sources = num_sources
        self._held = ""
        self.text = ""  # everything emitted so far

    def feed(self, delta: str) -> str:
        buffer = self._held + delta
        tail = _OPEN_TAIL.search(buffer)
        cut = tail.start() if tail else len(buffer)
        # Hold back trailing spaces too: a removed marker right after them would leave "word  ."
        while cut > 0 and buffer[cut - 1] in " \t" and tail:
            cut -= 1
        ready, self._held = buffer[:cut], buffer[cut:]
        return self._emit(ready)

    def flush(self) -> str:
        ready, self._held = self._held, ""
        return self._emit(ready)

    def _emit(self, ready: str) -> str:
        if not ready:
            return ""
        cleaned = clean_markers(ready, self.num_sources)
        if self.text.endswith(" ") and cleaned.startswith(" "):
            cleaned = cleaned.lstrip(" ")
        self.text += cleaned
        return cleaned


def marker_spans(text: str, numbers: Iterable[int]) -> dict[int, tuple[int, int]]:
    """For each source number, the (start, end) of the first marker in `text` that cites it."""
    wanted = set(numbers)
    spans: dict[int, tuple[int, int]] = {}
    for match in _MARKER.finditer(text):
        for n in (int(x) for x in match.group(1).split(",")):
            if n in wanted and n not in spans:
                spans[n] = (match.start(), match.end())
    return spans


def shown_source(source: str) -> str:
    """The name of a source as users see it: never an absolute server path.

    Sources are stored as paths under their ingest root (ingest/source_names.py); a collection
    ingested before that may still hold absolute paths, which are cut to the file name (and a
    JSONL record's `#id`) until the next `rag ingest --rebuild`.
    """
    if source.startswith("/"):
        return source.rsplit("/", 1)[-1]
    return source
