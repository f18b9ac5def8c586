"""Pages that differ only in their numbers (release notes 15.1 … 15.18, versioned pages) as one family.

A manual's release notes repeat the same boilerplate for every minor version ("a dump/restore is
not required for those running 15.X"); for a question that uses those words they fill all five
places, one page each, so the per-document cap alone does not help. Counting a family of pages
whose titles are equal once their numbers are removed as one document for the cap leaves room
for the pages that answer. Only titles that hold a number form families: two pages that share a
plain title ("README", "Notes") are not versions of one another.
"""

from __future__ import annotations

import re

from rag.types import Hit

_NUMBERS = re.compile(r"\d+(?:[.\-_]\d+)*")


def page_family(hit: Hit) -> str:
    """The hit's family key: its title without numbers if it holds one, else its document."""
    title = hit.title or ""
    if not _NUMBERS.search(title):
        return f"document:{hit.document_key}"
    words = _NUMBERS.sub(" ", title).casefold()
    # Section labels ("E.4.", "8.3.") leave letters and dots: keep only the words.
    key = " ".join(w for w in re.split(r"[^\w]+", words) if len(w) > 1)
    return f"family:{key}" if key else f"document:{hit.document_key}"
