"""Admonition titles head no section: the text after a DocBook or Sphinx note keeps its own heading."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest.chunk import Chunker, ChunkingConfig
from ingest.html_admonitions import drop_admonition_titles
from ingest.parse import parse_file

pytestmark = pytest.mark.filterwarnings("ignore")

# Cut down from the PostgreSQL 15 manual's sql-copy.html (DocBook XSL, XHTML namespace): a note
# inside the NULL parameter, then the next parameter, which the note's title used to head.
COPY_PAGE = """<?xml version="1.0" encoding="UTF-8" standalone="no"?>
<html xmlns="http://www.w3.org/1999/xhtml"><head><title>COPY</title></head><body>
<div class="refentry"><div class="refnamediv"><h2><span class="refentrytitle">COPY</span></h2>
<p>COPY — copy data between a file and a table</p></div>
<div class="refsect1"><h2>Parameters</h2><div class="variablelist"><dl>
<dt><span class="term"><code>NULL</code></span></dt><dd><p>Specifies the string that represents a null value.</p>
<div class="note"><h3 class="title">Note</h3><p>When using COPY FROM, any data item that matches this string
will be stored as a null value.</p></div></dd>
<dt><span class="term"><code>HEADER</code></span></dt><dd><p>Specifies that the file contains a header line
with the names of each column in the file.</p></dd></dl></div></div>
<div class="refsect1"><h2>Outputs</h2><p>On successful completion, a COPY command returns a command tag.</p></div>
</div></body></html>
"""


def test_docbook_note_title_is_dropped_and_its_text_kept() -> None:
    out = drop_admonition_titles(COPY_PAGE)
    assert 'class="title">Note<' not in out
    assert "any data item that matches this string" in out
    assert "<h2>Parameters</h2>" in out and "<h2>Outputs</h2>" in out  # real headings untouched


def test_sphinx_admonition_title_is_dropped() -> None:
    page = ('<html><body><h1>Install</h1><div class="admonition warning"><p class="admonition-title">Warning</p>'
            "<p>Back up first.</p></div><p>Run the installer.</p></body></html>")
    out = drop_admonition_titles(page)
    assert "admonition-title" not in out and ">Warning<" not in out
    assert "Back up first." in out and "Run the installer." in out


@pytest.mark.parametrize("page", [
    # a heading of class "title" that heads a section, not an admonition
    '<html><body><div class="sect1"><h2 class="title">8.3. Character Types</h2><p>Text.</p></div></body></html>',
    # a heading inside a note's body (not its first element) is the note's content
    '<html><body><div class="note"><p>First.</p><h4 class="title">Inner</h4><p>More.</p></div></body></html>',
    # no admonition at all: returned as is, not re-serialized
    "<html><body><h1>Plain</h1><p>Nothing to see.</p></body></html>",
])
def test_other_headings_stay(page: str) -> None:
    assert drop_admonition_titles(page) == page


def test_unreadable_html_is_returned_unchanged() -> None:
    assert drop_admonition_titles('class="note"') == 'class="note"'


def test_the_parameter_after_a_note_keeps_its_section_heading(tmp_path: Path, tokenizer) -> None:
    # Before: the note's "Note" was a Title, so HEADER's description was chunked under "Note".
    p = tmp_path / "sql-copy.html"
    p.write_text(COPY_PAGE)
    title, elements = parse_file(p)
    assert "Note" not in [e.text for e in elements if e.kind == "Title"]
    from rag.types import Document

    doc = Document(key="k", source="s", text="\n\n".join(e.text for e in elements), content_hash="h",
                   acl=None, title=title, elements=tuple(elements))
    chunks = Chunker(tokenizer, ChunkingConfig(max_tokens=48, overlap_tokens=8, title_context=True)).chunk(doc)
    header = [c for c in chunks if "header line" in c.text]
    assert header and all(c.heading == "Parameters" for c in header)
    assert all(c.heading != "Note" for c in chunks)
    note = [c for c in chunks if "any data item" in c.text]
    assert note and note[0].heading == "Parameters" and note[0].text.startswith("COPY › Parameters")
