"""Elements removed from HTML before parsing: one lxml parse and one serialization for every rule.

Each rule (navigation, admonition titles, ...) says cheaply whether a page may hold its elements
and which elements are doomed. Pages that no rule may touch are returned as they are, never
re-serialized; the others are parsed once, whatever the number of rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

_XML_DECLARATION = re.compile(r"^\s*<\?xml[^>]*\?>", re.IGNORECASE)


class PruneRule(NamedTuple):
    may_match: Callable[[str], bool]  # a cheap pre-check on the raw HTML
    matches: Callable[[Any], bool]  # an lxml element to drop (its tail text stays)


def prune_html(html: str, rules: Sequence[PruneRule]) -> str:
    """`html` without the elements that the rules match.

    Returns `html` unchanged when no rule matches, and when lxml cannot read it (the
    partitioner then reports the problem, as before).
    """
    rules = [rule for rule in rules if rule.may_match(html)]
    if not rules:
        return html
    try:
        import lxml.html
        from lxml import etree

        # lxml refuses a str that declares its own encoding; the text is already decoded.
        root = lxml.html.document_fromstring(_XML_DECLARATION.sub("", html, count=1))
    except (ValueError, etree.ParserError):
        return html
    doomed = [el for el in root.iter() if isinstance(el.tag, str) and any(rule.matches(el) for rule in rules)]
    if not doomed:
        return html
    for el in doomed:
        # drop_tree keeps the text that follows the element (its tail), which is the parent's.
        # An element inside another dropped one is dropped from the detached subtree: harmless.
        if el.getparent() is not None:
            el.drop_tree()
    return lxml.html.tostring(root, encoding="unicode")


def local_tag(el: Any) -> str:
    """The element's tag without an XHTML namespace, lower case."""
    return el.tag.rpartition("}")[2].lower()


def classes(el: Any) -> set[str]:
    return set((el.get("class") or "").lower().split())
