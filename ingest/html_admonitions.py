"""Admonition titles ("Note", "Tip", "Warning") removed from HTML before parsing, so they head no section.

DocBook renders a note as `<div class="note"><h3 class="title">Note</h3><p>…</p></div>`, Sphinx as
`<div class="admonition note"><p class="admonition-title">Note</p>…`. The partitioner reads that
title as a heading, and the chunker starts a section at every heading; the section then runs on
past the note until the next real heading. In the PostgreSQL manual 12% of all chunks were headed
"Note", "Tip", "Warning" or "Caution" (COPY's parameters NULL … WHERE among them, headed "COPY ›
Note"), so a chunk lost the heading that says what it is about, for the embedder, the keyword leg
and the reranker alike. Without its title the note's text stays in the section it sits in.
"""

from __future__ import annotations

import re

from ingest.html_prune import PruneRule, classes, local_tag, prune_html

# DocBook XSL's admonition classes; Sphinx marks its admonitions "admonition <kind>".
ADMONITION_CLASSES = frozenset({"note", "tip", "warning", "caution", "important", "admonition"})
_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
_PRECHECK = re.compile(r"class=[\"'][^\"']*\b(?:note|tip|warning|caution|important|admonition)\b", re.IGNORECASE)


def drop_admonition_titles(html: str) -> str:
    """`html` without the title elements of its admonitions; their body text stays where it is.

    A title is a heading of class "title" that is the first element of a `div` of an
    ADMONITION_CLASSES class (DocBook), or any element of class "admonition-title" (Sphinx).
    """
    return prune_html(html, [ADMONITION_TITLES])


def _is_admonition_title(el) -> bool:
    if "admonition-title" in classes(el):
        return True
    if local_tag(el) not in _HEADINGS or "title" not in classes(el):
        return False
    parent = el.getparent()
    if parent is None or local_tag(parent) != "div" or classes(parent).isdisjoint(ADMONITION_CLASSES):
        return False
    # Only the admonition's own title (its first element), not a heading inside its body.
    first = next((c for c in parent if isinstance(c.tag, str)), None)
    return first is el


ADMONITION_TITLES = PruneRule(lambda html: _PRECHECK.search(html) is not None, _is_admonition_title)
