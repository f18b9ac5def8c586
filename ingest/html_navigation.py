"""Remove navigation (site menus, DocBook header/footer bars, tables of contents) from HTML before parsing.

Navigation repeats on every page of a manual ("Prev Up Next Home" and the neighbours' titles),
so indexed it fills the store with near-identical chunks that match many questions and answer
none; a table of contents lists the titles of other pages, which pulls a chapter's index page
above the section that holds the answer. Neither is the page's own content.
"""

from __future__ import annotations

from ingest.html_prune import PruneRule, classes, local_tag, prune_html

# Class names of navigation blocks: DocBook XSL (navheader/navfooter bars, the "toc" and
# "list-of-*" blocks of chapter pages) and the common site-menu names.
NAVIGATION_CLASSES = frozenset({
    "navheader", "navfooter", "toc", "list-of-tables", "list-of-figures", "list-of-examples",
})
_NAVIGATION_TAGS = ("nav",)


def strip_navigation(html: str) -> str:
    """`html` without its navigation blocks: `<nav>`, role="navigation" and NAVIGATION_CLASSES."""
    return prune_html(html, [NAVIGATION])


def _may_have_navigation(html: str) -> bool:
    # A cheap pre-check so plain HTML without navigation is never re-serialized.
    lowered = html.lower()
    return "<nav" in lowered or "navigation" in lowered or any(c in lowered for c in NAVIGATION_CLASSES)


def _is_navigation(el) -> bool:
    if local_tag(el) in _NAVIGATION_TAGS:
        return True
    if (el.get("role") or "").strip().lower() == "navigation":
        return True
    return not classes(el).isdisjoint(NAVIGATION_CLASSES)


NAVIGATION = PruneRule(_may_have_navigation, _is_navigation)
