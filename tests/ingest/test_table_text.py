"""Parsed tables as Markdown rows (ingest/table_text.py), from the real parser's HTML."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.table_text import markdown_table

LAB_DOCS = Path(__file__).resolve().parents[2] / "examples" / "lab-docs"


def _tables(path: Path) -> list:
    """unstructured's Table elements of a sample document (the partitioner ingest uses for it)."""
    if path.suffix == ".md":
        from unstructured.partition.md import partition_md as partition
    else:
        from unstructured.partition.html import partition_html as partition
    return [el for el in partition(filename=str(path), languages=["eng"]) if el.category == "Table"]


def test_a_markdown_table_keeps_its_rows_and_header():
    (table,) = _tables(LAB_DOCS / "public" / "seminar-schedule.md")
    assert "\n" not in table.text  # what unstructured flattens
    lines = markdown_table(table.metadata.text_as_html).splitlines()
    assert lines[0] == "| Date | Speaker | Title |" and lines[1] == "| --- | --- | --- |"
    assert "| 9 Apr 2025 | Prof. Anna Weiss (ETH Zurich) | Cryo-electron tomography of the nuclear pore |" in lines
    assert len(lines) == 2 + 8  # header, separator, the eight dates


def test_an_html_table_keeps_its_rows_and_header():
    (table,) = _tables(LAB_DOCS / "public" / "slurm-partitions.html")
    lines = markdown_table(table.metadata.text_as_html).splitlines()
    assert lines[0] == "| Partition | Nodes | Default time | Max time | Default QOS |"
    assert "| gpu | gpu01-gpu08 | 1 hour | 48 hours | gpu-normal |" in lines


@pytest.mark.parametrize(("html", "expected"), [
    (None, None), ("", None), ("<table></table>", None), ("<table><tr><td> </td></tr></table>", None),
    # no header cells: no separator line, so no row is taken for a header
    ("<table><tr><td>a</td><td>b</td></tr><tr><td>c</td></tr></table>", "| a | b |\n| c |  |"),
    # a pipe in a cell would end it; whitespace and <br> inside a cell collapse to one line
    ("<table><tr><th>x|y</th></tr><tr><td>one<br>two\n three</td></tr></table>",
     "| x/y |\n| --- |\n| one two three |"),
    # a nested table is text of its cell, not rows of the outer table
    ("<table><tr><th>k</th><th>v</th></tr><tr><td>a</td><td><table><tr><td>n1</td></tr><tr><td>n2</td></tr>"
     "</table></td></tr></table>", "| k | v |\n| --- | --- |\n| a | n1 n2 |"),
])
def test_edge_cases(html, expected):
    assert markdown_table(html) == expected
