"""Parsing real files of every supported format, and refusing bad ones with a clear reason."""

from __future__ import annotations

import hashlib
import pathlib
from pathlib import Path

import pytest

from ingest.parse import parse_file, parse_item
from ingest.sources import SourceItem, walk_sources
from rag.errors import ParseError

pytestmark = pytest.mark.filterwarnings("ignore")

MD = """# Cluster Guide

Jobs are submitted with sbatch and monitored with squeue. The scheduler is fair-share.

## Storage

- Home directories have a quota of fifty gigabytes.
- Scratch is purged after thirty days.
"""


def kinds_texts(elements):
    return [(e.kind, e.text) for e in elements]


def test_markdown_headings_become_titles(tmp_path: Path) -> None:
    p = tmp_path / "guide.md"
    p.write_text(MD)
    title, els = parse_file(p)
    assert title == "Cluster Guide"
    assert ("Title", "Cluster Guide") in kinds_texts(els)
    assert ("Title", "Storage") in kinds_texts(els)
    assert ("ListItem", "Scratch is purged after thirty days.") in kinds_texts(els)
    assert any("sbatch" in e.text for e in els)
    assert all(e.page is None for e in els)


def test_html_keeps_text_drops_script(tmp_path: Path) -> None:
    p = tmp_path / "page.html"
    p.write_text(
        "<html><head><title>ignored</title><script>var secret = 1;</script></head><body>"
        "<h1>Slurm Partitions</h1><p>The gpu partition has eight nodes with four GPUs each.</p>"
        "<h2>Limits</h2><ul><li>48 hours per job</li></ul></body></html>"
    )
    title, els = parse_file(p)
    assert title == "Slurm Partitions"
    text = "\n".join(e.text for e in els)
    assert "eight nodes" in text and "48 hours per job" in text
    assert "secret" not in text
    assert ("Title", "Limits") in kinds_texts(els)


# A DocBook XSL page as the PostgreSQL manual ships it (XML declaration, XHTML namespace), cut
# down: a navigation header and footer, a table of contents, a site menu and a role=navigation list.
DOCBOOK_PAGE = """<?xml version="1.0" encoding="UTF-8" standalone="no"?>
<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN" "http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">
<html xmlns="http://www.w3.org/1999/xhtml"><head><title>21.9. Peer Authentication</title></head><body>
<nav><a href="/">Lab wiki</a> <a href="/jobs">Jobs menu</a></nav>
<div class="navheader"><table summary="Navigation header"><tr><th colspan="5">21.9. Peer Authentication</th></tr>
<tr><td><a accesskey="p" href="auth-ident.html">Prev</a></td><td><a href="client-authentication.html">Up</a></td>
<th>Chapter 21. Client Authentication</th><td><a href="index.html">Home</a></td>
<td><a href="auth-ldap.html">Next</a></td></tr></table><hr /></div>
<div class="sect1"><h2 class="title">21.9. Peer Authentication</h2>
<div class="toc"><p><b>Table of Contents</b></p><dl><dt>21.9.1. Ident Maps Elsewhere</dt></dl></div>
<p>The peer authentication method obtains the client's operating system user name from the kernel.</p>
<ul role="navigation"><li><a href="auth-ldap.html">See also LDAP</a></li></ul>
<p>Peer authentication is only available on local connections.</p></div>
<div class="navfooter"><hr /><table summary="Navigation footer"><tr><td><a href="auth-ident.html">Prev</a></td>
<td><a href="client-authentication.html">Up</a></td><td><a href="auth-ldap.html">Next</a></td></tr>
<tr><td>21.8. Ident Authentication</td><td><a href="index.html">Home</a></td><td>21.10. LDAP Authentication</td>
</tr></table></div></body></html>
"""


def test_html_navigation_and_tables_of_contents_are_not_content(tmp_path: Path) -> None:
    p = tmp_path / "auth-peer.html"
    p.write_text(DOCBOOK_PAGE)
    title, els = parse_file(p)
    assert title == "21.9. Peer Authentication"
    assert [e.text for e in els] == [  # kinds of body text are unstructured's guess: not checked
        "21.9. Peer Authentication",
        "The peer authentication method obtains the client's operating system user name from the kernel.",
        "Peer authentication is only available on local connections.",
    ]
    assert els[0].kind == "Title"


@pytest.mark.parametrize("suffix", [".html", ".md", ".docx"])
def test_tables_keep_their_rows(tmp_path: Path, suffix: str) -> None:
    # unstructured flattens a table to its cells joined by spaces; a chunk of that reads as one
    # endless sentence to the reranker, the extractive answerer and the generator.
    rows = [("Partition", "Max time"), ("gpu", "48 hours"), ("debug", "30 minutes")]
    path = tmp_path / f"t{suffix}"
    if suffix == ".html":
        cells = "".join("<tr>" + "".join(f"<{t}>{c}</{t}>" for c in r) + "</tr>"
                        for r, t in zip(rows, ["th", "td", "td"], strict=True))
        path.write_text(f"<html><body><h1>Partitions</h1><table>{cells}</table></body></html>")
    elif suffix == ".md":
        path.write_text("# Partitions\n\n| Partition | Max time |\n|---|---|\n"
                        "| gpu | 48 hours |\n| debug | 30 minutes |\n")
    else:
        import docx

        d = docx.Document()
        d.add_heading("Partitions", 1)
        table = d.add_table(rows=3, cols=2)
        for i, r in enumerate(rows):
            for j, c in enumerate(r):
                table.cell(i, j).text = c
        d.save(path)
    _, elements = parse_file(path)
    (table_text,) = [e.text for e in elements if e.kind == "Table"]
    lines = table_text.splitlines()
    assert lines[0] == "| Partition | Max time |"
    assert "| gpu | 48 hours |" in lines and "| debug | 30 minutes |" in lines


def test_html_of_navigation_only_has_no_text(tmp_path: Path) -> None:
    p = tmp_path / "menu.html"
    p.write_text('<html><body><nav><a href="/a">Prev</a> <a href="/b">Next</a></nav>'
                 '<div class="navfooter">Up Home</div></body></html>')
    with pytest.raises(ParseError, match="no text extracted"):
        parse_file(p)


def test_plain_text_title_falls_back_to_stem(tmp_path: Path) -> None:
    p = tmp_path / "storage-notes.txt"
    p.write_text(
        "Home directories are backed up every night.\n\n"
        "Scratch space is not backed up. Files older than thirty days are removed.\n"
    )
    title, els = parse_file(p)
    assert title == "storage-notes"
    assert [e.text for e in els] == [
        "Home directories are backed up every night.",
        "Scratch space is not backed up. Files older than thirty days are removed.",
    ]
    # A line ending like a sentence is body text even though the offline spaCy stub
    # has no tagger to tell (it would otherwise come out as Title).
    assert all(e.kind != "Title" for e in els)


def test_utf8_bom_and_non_ascii(tmp_path: Path) -> None:
    p = tmp_path / "notes.md"
    p.write_bytes("\ufeff# Café Ω\n\nMünchen liegt an der Isar, und das ist schön.\n".encode())
    title, els = parse_file(p)
    assert title == "Café Ω"
    assert any("München" in e.text for e in els)


def test_docx(tmp_path: Path) -> None:
    docx = pytest.importorskip("docx")
    d = docx.Document()
    d.add_heading("Onboarding", 1)
    d.add_paragraph("Request an account through the portal. Approval takes one working day.")
    d.add_heading("First login", 2)
    d.add_paragraph("Log in with your SSH key and a one-time code from the authenticator.")
    p = tmp_path / "onboarding.docx"
    d.save(p)
    title, els = parse_file(p)
    assert title == "Onboarding"
    assert ("Title", "First login") in kinds_texts(els)
    assert any("one-time code" in e.text for e in els)


def test_pdf_text_and_pages(make_pdf) -> None:
    p = make_pdf([
        ["Maintenance Plan"],
        ["The cluster is down on Tuesday from seven to seven.", "Save your checkpoints."],
    ], name="plan.pdf")
    title, els = parse_file(p)
    assert title == "Maintenance Plan"
    by_text = {e.text: e.page for e in els}
    assert by_text["Maintenance Plan"] == 1
    second = [e for e in els if "Tuesday" in e.text]
    assert second and second[0].page == 2
    assert any("checkpoints" in e.text for e in els)


def test_pdf_without_text_layer(make_pdf) -> None:
    p = make_pdf([[]], name="scan.pdf")  # a page with no text (like a scan without OCR)
    with pytest.raises(ParseError, match="^no text extracted$"):
        parse_file(p)


def test_corrupt_pdf_garbage(tmp_path: Path) -> None:
    p = tmp_path / "broken.pdf"
    p.write_bytes(b"%PDF-1.4\n1 0 obj garbage\n")
    with pytest.raises(ParseError, match="^corrupt PDF: .+"):
        parse_file(p)


def test_corrupt_pdf_truncated(tmp_path: Path, pdf_data) -> None:
    p = tmp_path / "truncated.pdf"
    p.write_bytes(pdf_data([["a perfectly good line of text"]])[:180])  # xref, trailer gone
    with pytest.raises(ParseError, match="^corrupt PDF: .+"):
        parse_file(p)


def test_not_a_pdf(tmp_path: Path) -> None:
    p = tmp_path / "report.pdf"
    p.write_text("this is plain text with a .pdf name")
    with pytest.raises(ParseError, match="^corrupt PDF: no %PDF header"):
        parse_file(p)


def test_corrupt_docx(tmp_path: Path) -> None:
    p = tmp_path / "broken.docx"
    p.write_bytes(b"PK\x03\x04 this is not really a zip archive")
    with pytest.raises(ParseError, match="^corrupt DOCX: "):
        parse_file(p)


def test_zip_that_is_not_a_docx(tmp_path: Path) -> None:
    import zipfile

    p = tmp_path / "archive.docx"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("hello.txt", "hello")
    with pytest.raises(ParseError, match="^corrupt DOCX: no word/document.xml"):
        parse_file(p)


@pytest.mark.parametrize("name", ["empty.md", "empty.txt", "empty.pdf", "empty.docx"])
def test_empty_file(tmp_path: Path, name: str) -> None:
    p = tmp_path / name
    p.write_bytes(b"")
    with pytest.raises(ParseError, match="^empty file$"):
        parse_file(p)


def test_whitespace_only_has_no_text(tmp_path: Path) -> None:
    p = tmp_path / "blank.md"
    p.write_text("\n   \n\t\n")
    with pytest.raises(ParseError, match="^no text extracted$"):
        parse_file(p)


@pytest.mark.parametrize("suffix", [".txt", ".md", ".html"])
def test_binary_content_in_text_file(tmp_path: Path, suffix: str) -> None:
    p = tmp_path / f"data{suffix}"
    p.write_bytes(bytes(range(256)) * 8)  # NUL bytes and control characters
    with pytest.raises(ParseError, match="^binary content in a text file$"):
        parse_file(p)


def test_binary_without_nul_bytes(tmp_path: Path) -> None:
    p = tmp_path / "blob.txt"
    p.write_bytes(bytes(b % 31 + 1 for b in range(4000)))  # control bytes, no NUL
    with pytest.raises(ParseError, match="^binary content in a text file$"):
        parse_file(p)


def test_invalid_utf8_names_the_byte(tmp_path: Path) -> None:
    p = tmp_path / "latin1.txt"
    p.write_bytes("Caf\u00e9 au lait.\n".encode("latin-1"))  # é is 0xE9: bad UTF-8 at byte 3
    with pytest.raises(ParseError, match="^invalid UTF-8 at byte 3"):
        parse_file(p)


def test_invalid_utf8_after_bom_counts_file_bytes(tmp_path: Path) -> None:
    p = tmp_path / "bom.md"
    p.write_bytes(b"\xef\xbb\xbfab\xffcd")
    with pytest.raises(ParseError, match="^invalid UTF-8 at byte 5"):
        parse_file(p)


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests may run as root, for whom chmod 000 changes nothing: make this one path's
    # open() fail the way it does for an ordinary user.
    p = tmp_path / "secret.md"
    p.write_text("# Secret\n")
    real_open = pathlib.Path.open

    def deny(self, *args, **kwargs):
        if self == p:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", deny)
    with pytest.raises(ParseError, match="^cannot read file: Permission denied"):
        parse_file(p)


def test_unsupported_suffix(tmp_path: Path) -> None:
    p = tmp_path / "table.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ParseError, match="unsupported file type .csv"):
        parse_file(p)


def _item(**kw) -> SourceItem:
    base = dict(key="/data/faq.jsonl#q1", path=Path("/data/faq.jsonl"), kind="record",
                content_hash="abc", acl=frozenset({"group:genomics"}), acl_origin="record")
    base.update(kw)
    return SourceItem(**base)


def test_parse_item_record_paragraphs() -> None:
    item = _item(title="Password reset", text="First paragraph.\n\n  \nSecond one\nspans lines.",
                 metadata={"category": "accounts"})
    doc = parse_item(item)
    assert [(e.kind, e.text) for e in doc.elements] == [
        ("NarrativeText", "First paragraph."),
        ("NarrativeText", "Second one\nspans lines."),
    ]
    assert doc.text == "First paragraph.\n\nSecond one\nspans lines."
    assert doc.key == item.key and doc.source == item.key
    assert doc.acl == frozenset({"group:genomics"})
    assert doc.title == "Password reset"
    assert doc.content_hash == "abc"
    assert doc.metadata == {"category": "accounts"}


def test_parse_item_file(tmp_path: Path) -> None:
    p = tmp_path / "guide.md"
    p.write_text(MD)
    (item,) = list(walk_sources([p]))
    doc = parse_item(item)
    assert doc.key == str(p.resolve()) and doc.source == f"{tmp_path.name}/guide.md"  # never the server path
    assert doc.title == "Cluster Guide"
    assert doc.content_hash == hashlib.sha256(p.read_bytes()).hexdigest()
    assert doc.acl == item.acl
    assert doc.text == "\n\n".join(e.text for e in doc.elements)
    assert "fair-share" in doc.text


def test_a_missing_spacy_model_is_named_with_its_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Offline, unstructured's attempt to download en_core_web_sm fails on every document with
    # "No module named 'installer'"; the problem must say what is missing and how to install it.
    from unstructured.nlp import tokenize

    def _load_spacy_model():  # named as unstructured's own: the traceback is what is recognized
        raise ModuleNotFoundError("No module named 'installer'")

    monkeypatch.setattr(tokenize, "_get_nlp", lambda: _load_spacy_model())
    path = tmp_path / "notes.txt"
    path.write_text("The buffer recipe was changed last week after the audit of the imaging lab. "
                    "Everyone should read the new protocol before the next session starts.\n")
    with pytest.raises(ParseError, match=r"en_core_web_sm.*build_spacy_stub\.sh.*installer"):
        parse_file(path)

    def broken():
        raise ValueError("something else")

    monkeypatch.setattr(tokenize, "_get_nlp", broken)
    path.write_text("Another paragraph of narrative text, long enough to be classified by the parser.\n")
    with pytest.raises(ParseError) as caught:
        parse_file(path)
    assert "en_core_web_sm" not in str(caught.value) and "something else" in str(caught.value)
