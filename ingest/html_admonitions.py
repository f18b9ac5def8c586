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

# DocBook XSL's admonition classes; Sphinx marks its admonitions "admonition <kind>".
ADMONITION_CLASSES = frozenset({"note", "tip", "warning", "caution", "important", "admonition"})
_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
_XML_DECLARATION = re.compile(r"^\s*<\?xml[^>]*\?>", re.IGNORECASE)
_PRECHECK = re.compile(r"class=[\"'][^\"']*\b(?:note|tip|warning|caution|important|admonition)\b", re.IGNORECASE)


def drop_admonition_titles(html: str) -> str:
    """`html` without the title elements of its admonitions; their body text stays where it is.

    A title is a heading of class "title" that is the first element of a `div` of an
    ADMONITION_CLASSES class (DocBook), or any element of class "admonition-title" (Sphinx).
    Returns `html` unchanged when it has none, and when lxml cannot read it (the partitioner
    then reports the problem, as before).
    """
    if not _PRECHECK.search(html):
        return html
    try:
        import lxml.html
        from lxml import etree

        # lxml refuses a str that declares its own encoding; the text is already decoded.
        root = lxml.html.document_fromstring(_XML_DECLARATION.sub("", html, count=1))
    except (ValueError, etree.ParserError):
        return html
    doomed = [el for el in root.iter() if isinstance(el.tag, str) and _is_admonition_title(el)]
    if not doomed:
        return html
    for el in doomed:
        el.drop_tree()  # keeps the title's tail text, which belongs to the admonition's body
    return lxml.html.tostring(root, encoding="unicode")


def _classes(el) -> set[str]:
    return set((el.get("class") or "").lower().split())


def _is_admonition_title(el) -> bool:
    if "admonition-title" in _classes(el):
        return True
    tag = el.tag.rpartition("}")[2].lower()  # XHTML pages may carry a namespace
    if tag not in _HEADINGS or "title" not in _classes(el):
        return False
    parent = el.getparent()
    if parent is None or parent.tag.rpartition("}")[2].lower() != "div":
        return False
    if _classes(parent).isdisjoint(ADMONITION_CLASSES):
        return False
    # Only the admonition's own title (its first element), not a heading inside its body.
    first = next((c for c in parent if isinstance(c.tag, str)), None)
    return first is el
