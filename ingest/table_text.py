"""A parsed table as Markdown rows, one line each, instead of unstructured's flattened text.

unstructured gives a Table element's text as every cell joined by spaces ("Date Speaker Title
15 Jan 2025 Dr. Priya Raman ..."): row boundaries and the header are lost, so a chunk of it
reads as one endless sentence to the reranker, the extractive answerer and the generator. Its
`metadata.text_as_html` keeps the structure; this turns that HTML into a Markdown table:

    | Date | Speaker | Title |
    | --- | --- | --- |
    | 15 Jan 2025 | Dr. Priya Raman (NIQB) | Long-read assembly of repetitive plant genomes |

The separator line follows the header only when the first row is header cells (<th>), as in
Markdown, so a reader (rag/extractive.py) can tell a header from a first data row. The chunker
cuts long text at line breaks, so a table split across chunks is split between rows.
"""

from __future__ import annotations

from html.parser import HTMLParser

__all__ = ["markdown_table"]


def markdown_table(html: str | None) -> str | None:
    """The table in `html` (unstructured's `text_as_html`) as Markdown rows; None if it has no cells."""
    if not html:
        return None
    parser = _Rows()
    parser.feed(html)
    parser.close()
    rows = [r for r in parser.rows if any(text for text, _ in r)]
    if not rows:
        return None
    width = max(len(r) for r in rows)
    lines = []
    for i, row in enumerate(rows):
        cells = [text for text, _ in row] + [""] * (width - len(row))
        lines.append(_line(cells))
        if i == 0 and all(is_header for _, is_header in row):
            lines.append(_line(["---"] * width))
    return "\n".join(lines)


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


class _Rows(HTMLParser):
    """Rows of (cell text, is a header cell); nested tables' cells count as their cell's text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[list[tuple[str, bool]]] = []
        self._cell: list[str] | None = None
        self._header = False
        self._depth = 0  # of <table>: rows of a nested table stay inside the outer cell

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._depth += 1
        elif self._depth > 1:  # a nested table's cells: words of the outer cell, kept apart
            if self._cell is not None and tag in ("tr", "td", "th", "br"):
                self._cell.append(" ")
        elif tag == "tr":
            self._end_cell()
            self.rows.append([])
        elif tag in ("td", "th"):
            self._end_cell()
            if not self.rows:
                self.rows.append([])
            self._cell, self._header = [], tag == "th"
        elif tag == "br" and self._cell is not None:
            self._cell.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._depth -= 1
            if self._depth == 0:
                self._end_cell()
        elif self._depth == 1 and tag in ("td", "th", "tr"):
            self._end_cell()

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def _end_cell(self) -> None:
        if self._cell is None:
            return
        # One line per row: whitespace inside a cell collapses, and a pipe in a cell would end it.
        text = " ".join("".join(self._cell).split()).replace("|", "/")
        self.rows[-1].append((text, self._header))
        self._cell = None
