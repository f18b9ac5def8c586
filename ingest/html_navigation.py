"""Remove navigation (site menus, DocBook header/footer bars, tables of contents) from HTML before parsing.

Navigation repeats on every page of a manual ("Prev Up Next Home" and the neighbours' titles),
so indexed it fills the store with near-identical chunks that match many questions and answer
none; a table of contents lists the titles of other pages, which pulls a chapter's index page
above the section that holds the answer. Neither is the page's own content.
"""

from __future__ import annotations

import re

# Class names of navigation blocks: DocBook XSL (navheader/navfooter bars, the "toc" and
# "list-of-*" blocks of chapter pages) and the common site-menu names.
NAVIGATION_CLASSES = frozenset({
    "navheader", "navfooter", "toc", "list-of-tables", "list-of-figures", "list-of-examples",
})
_NAVIGATION_TAGS = ("nav",)
_XML_DECLARATION = re.compile(r"^\s*<\?xml[^>]*\?>", re.IGNORECASE)


def strip_navigation(html: str) -> str:
    """`html` without its navigation blocks: `<nav>`, role="navigation" and NAVIGATION_CLASSES.

    Returns `html` unchanged when it has no such block, and when lxml cannot read it (the
    partitioner then reports the problem, as before).
    """
    if not _may_have_navigation(html):
        return html
    try:
        import lxml.html
        from lxml import etree

        # lxml refuses a str that declares its own encoding; the text is already decoded.
        root = lxml.html.document_fromstring(_XML_DECLARATION.sub("", html, count=1))
    except (ValueError, etree.ParserError):
        return html
    doomed = [el for el in root.iter() if isinstance(el.tag, str) and _is_navigation(el)]
    if not doomed:
        return html
    for el in doomed:
        # drop_tree keeps the text that follows the block (its tail), which is the parent's.
        # A block inside another dropped one is dropped from the detached subtree: harmless.
        if el.getparent() is not None:
            el.drop_tree()
    return lxml.html.tostring(root, encoding="unicode")


def _may_have_navigation(html: str) -> bool:
    # A cheap pre-check so plain HTML without navigation is never re-serialized.
    lowered = html.lower()
    return "<nav" in lowered or "navigation" in lowered or any(c in lowered for c in NAVIGATION_CLASSES)


def _is_navigation(el) -> bool:
    tag = el.tag.rpartition("}")[2].lower()  # XHTML pages may carry a namespace
    if tag in _NAVIGATION_TAGS:
        return True
    if (el.get("role") or "").strip().lower() == "navigation":
        return True
    classes = set((el.get("class") or "").lower().split())
    return not classes.isdisjoint(NAVIGATION_CLASSES)

