"""Parse sources into Documents: files through unstructured, JSONL records as paragraphs."""

from __future__ import annotations

import io
import itertools
import logging
import os
import re
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ingest.html_admonitions import ADMONITION_TITLES
from ingest.html_navigation import NAVIGATION
from ingest.html_prune import prune_html
from ingest.sources import SourceItem
from ingest.table_text import markdown_table
from ingest.text_blocks import check_text_file, first_lines, text_blocks
from rag.errors import ParseError
from rag.types import Document, Element

TEXT_SUFFIXES = {".md", ".markdown", ".txt", ".html", ".htm"}
# Elements that carry no content of their own.
_SKIPPED_KINDS = {"PageBreak"}
# A title introduces the document; a heading further down titles a section, not the document.
_TITLE_WITHIN = 5
# Bytes sampled for the binary check: enough to see a file's nature, cheap for huge files.
_SNIFF_BYTES = 8192
# Plain text and Markdown files above this size are parsed block by block (ingest/text_blocks.py)
# instead of whole: the same elements, with one block in memory instead of the whole file's
# objects. Other formats must be parsed whole; the ingest size cap bounds those.
STREAM_ABOVE_BYTES = 8 << 20
STREAMED_SUFFIXES = {".txt", ".md", ".markdown"}
# unstructured's text partitioner picks its paragraph grouper from the first lines of the text.
_GROUPER_LINES = 2000


def parse_file(path: Path) -> tuple[str | None, list[Element]]:
    """Parse one file into its title and elements.

    Args:
        path: a .md/.markdown, .txt, .html/.htm, .pdf or .docx file.

    Returns:
        (title, elements): the first Title element near the top, else the file's stem;
        elements in reading order, each with unstructured's category and the page (PDF).

    Raises:
        ParseError: unreadable, empty, binary, invalid UTF-8, corrupt, unsupported, or
            no text extracted; the message says which.
    """
    suffix = path.suffix.lower()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ParseError(f"cannot read file: {e.strerror or e}") from e
    if not data:
        raise ParseError("empty file")
    if suffix in TEXT_SUFFIXES:
        raw = _partition_text_format(suffix, _decode_text(data))
    elif suffix == ".pdf":
        _check_pdf(data)
        # "fast" (pdfminer's text layer): the other strategies need a layout or OCR model
        # from the hub. A scanned PDF without a text layer yields "no text extracted".
        raw = _partition(_partitioner("pdf"), "corrupt PDF", filename=str(path), strategy="fast")
    elif suffix == ".docx":
        _check_docx(data)
        raw = _partition(_partitioner("docx"), "corrupt DOCX", filename=str(path))
    else:
        raise ParseError(f"unsupported file type {suffix or '(no suffix)'}")
    elements = _to_elements(raw, heuristic_titles=suffix in (".txt", ".pdf"))
    if not elements:
        raise ParseError("no text extracted")
    return _title(elements, path, heuristic_titles=suffix in (".txt", ".pdf")), elements


def parse_item(item: SourceItem) -> Document:
    """Build the Document for one source: parse a file, or split a record into paragraphs.

    Raises:
        ParseError: the file cannot be parsed (see `parse_file`) or the record has no text.
    """
    if item.kind == "record":
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", item.text or "")]
        elements = [Element(kind="NarrativeText", text=p) for p in paragraphs if p]
        if not elements:
            raise ParseError("no text extracted")
        title = item.title
        source = item.display or item.key  # "file.jsonl#id" says more than the bare file
    else:
        title, elements = parse_file(item.path)
        title = item.title or title
        source = item.display or str(item.path)
    return Document(
        key=item.key,
        source=source,
        text="\n\n".join(e.text for e in elements),
        content_hash=item.content_hash,
        acl=item.acl,
        title=title,
        elements=tuple(elements),
        metadata=dict(item.metadata),
    )


def document_bytes(item: SourceItem) -> int:
    """The size a source is capped by: the file's bytes, or a record's text in UTF-8."""
    if item.kind == "record":
        return len((item.text or "").encode("utf-8", "surrogatepass"))
    return item.path.stat().st_size


def parse_item_stream(item: SourceItem, stream_above: int = STREAM_ABOVE_BYTES
                      ) -> tuple[Document, Iterator[Element]]:
    """The Document for one source (without its text and elements) and its elements, lazily.

    A text or Markdown file above `stream_above` bytes is read and partitioned a block at a time
    as the elements are consumed; anything else is parsed whole (`parse_item`). The file is
    checked through (binary content, UTF-8) before this returns, so a bad byte late in a huge file
    fails before any of it is chunked; a parser failure in a later block raises ParseError from
    the iterator.

    Raises:
        ParseError: as `parse_item`.
    """
    suffix = item.path.suffix.lower()
    if not is_streamed(item, stream_above):
        doc = parse_item(item)
        elements = doc.elements
        return _without_text(doc), iter(elements)
    path = item.path
    heuristic = suffix == ".txt"
    _sniff(path)
    check_text_file(path)
    elements = _streamed_elements(path, markdown=not heuristic)
    head = list(itertools.islice(elements, _TITLE_WITHIN))
    if not head:
        raise ParseError("no text extracted")
    title = item.title or _title(head, path, heuristic_titles=heuristic)
    doc = Document(key=item.key, source=item.display or str(path), text="", content_hash=item.content_hash,
                   acl=item.acl, title=title, elements=(), metadata=dict(item.metadata))
    return doc, itertools.chain(head, elements)


def is_streamed(item: SourceItem, stream_above: int = STREAM_ABOVE_BYTES) -> bool:
    """Whether `parse_item_stream` reads `item` a block at a time (rather than parsing it whole)."""
    return item.kind == "file" and item.path.suffix.lower() in STREAMED_SUFFIXES and _size(item.path) > stream_above


def _without_text(doc: Document) -> Document:
    # Chunks carry the text; a document waiting for the embedder holds no second copy.
    return Document(key=doc.key, source=doc.source, text="", content_hash=doc.content_hash, acl=doc.acl,
                    title=doc.title, elements=(), metadata=doc.metadata)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise ParseError(f"cannot read file: {e.strerror or e}") from e


def _sniff(path: Path) -> None:
    try:
        with path.open("rb") as f:
            sample = f.read(_SNIFF_BYTES)
    except OSError as e:
        raise ParseError(f"cannot read file: {e.strerror or e}") from e
    if b"\x00" in sample or _control_ratio(sample) > 0.10:
        raise ParseError("binary content in a text file")


def _streamed_elements(path: Path, markdown: bool) -> Iterator[Element]:
    by_lines = False
    if markdown:
        partition, fmt, extra = _partitioner("md"), "MD", {}
    else:
        # Chosen once from the file's first lines, as partition_text does for a whole text.
        chosen, by_lines = _grouper_for(first_lines(path, _GROUPER_LINES))
        partition, fmt, extra = _partitioner("text"), "TEXT", {"paragraph_grouper": chosen}
    for block in text_blocks(path, markdown, lines_are_paragraphs=by_lines):
        if not block.strip():
            continue
        raw = _partition(partition, f"cannot parse {fmt}", text=block, **extra)
        yield from _to_elements(raw, heuristic_titles=not markdown)


def _grouper_for(sample: str) -> tuple[Callable[[str], str], bool]:
    """The grouper auto_paragraph_grouper picks for a text starting with `sample` (same rule), and
    whether it is the one that makes each line a paragraph."""
    from unstructured.cleaners.core import blank_line_grouper, new_line_grouper
    from unstructured.nlp.patterns import LINE_BREAK_RE

    lines = LINE_BREAK_RE.split(sample)[:_GROUPER_LINES]
    empty = sum(1 for line in lines if not line.strip())
    by_lines = empty / len(lines) < 0.1
    return (new_line_grouper if by_lines else blank_line_grouper), by_lines


# ----------------------------------------------------------------------------- validation


def _decode_text(data: bytes) -> str:
    """Decode a text file strictly: binary content and bad UTF-8 are errors, not mojibake."""
    sample = data[:_SNIFF_BYTES]
    if b"\x00" in sample or _control_ratio(sample) > 0.10:
        raise ParseError("binary content in a text file")
    try:
        text = data.decode("utf-8-sig")  # -sig: a leading BOM is not content
    except UnicodeDecodeError as e:
        # Offsets are into the BOM-less text when a BOM was present; report file offsets.
        offset = e.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        raise ParseError(
            f"invalid UTF-8 at byte {offset} (convert the file to UTF-8, e.g. with iconv)"
        ) from None
    if "\x00" in text:
        raise ParseError("binary content in a text file")
    return text


def _control_ratio(sample: bytes) -> float:
    # Control bytes other than tab, LF, FF and CR hardly occur in text but are common in binaries.
    if not sample:
        return 0.0
    n = sum(1 for b in sample if b < 0x20 and b not in (0x09, 0x0A, 0x0C, 0x0D))
    return n / len(sample)


def _check_pdf(data: bytes) -> None:
    """Reject corrupt and encrypted PDFs up front.

    unstructured's fast strategy logs and returns nothing for a broken PDF (and its other
    strategies need a model from the hub), so without this check the user would only see
    "no text extracted".
    """
    if b"%PDF-" not in data[:1024]:
        raise ParseError("corrupt PDF: no %PDF header (not a PDF file)")
    from pypdf import PdfReader

    pypdf_log = logging.getLogger("pypdf")
    level = pypdf_log.level
    pypdf_log.setLevel(logging.ERROR)  # its warnings repeat what the ParseError says
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and not reader.decrypt(""):
            raise ParseError("encrypted PDF: remove the password before ingesting")
        num_pages = len(reader.pages)
    except ParseError:
        raise
    except Exception as e:  # pypdf raises many types; they all mean "cannot read this PDF"
        raise ParseError(f"corrupt PDF: {_short(e)}") from e
    finally:
        pypdf_log.setLevel(level)
    if num_pages == 0:
        raise ParseError("corrupt PDF: no pages")


def _check_docx(data: bytes) -> None:
    """Reject files that are not DOCX packages, with a short reason."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = set(z.namelist())
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise ParseError(f"corrupt DOCX: not a ZIP archive ({_short(e)})") from e
    if "word/document.xml" not in names:
        raise ParseError("corrupt DOCX: no word/document.xml (not a Word document)")


# ---------------------------------------------------------------------------- partitioning


def _partition_text_format(suffix: str, text: str) -> list[Any]:
    if not text.strip():
        raise ParseError("no text extracted")
    kind = {".md": "md", ".markdown": "md", ".txt": "text", ".html": "html", ".htm": "html"}
    fmt = kind[suffix]
    if fmt == "html":
        # Menus and "Prev Up Next" bars are no page's content, and a "Note" box title must not
        # head the text that follows it: one parse of the page for both.
        text = prune_html(text, (NAVIGATION, ADMONITION_TITLES))
    # Passing the decoded text (not the file) keeps our strict UTF-8 decision authoritative.
    return _partition(_partitioner(fmt), f"cannot parse {fmt.upper()}", text=text)


def _partitioner(fmt: str) -> Callable[..., list[Any]]:
    """Import unstructured lazily: it takes seconds (torch, spaCy) and only parsing needs it."""
    os.environ.setdefault("DO_NOT_TRACK", "1")  # otherwise import waits on an analytics ping
    os.environ.setdefault("UNSTRUCTURED_DISABLE_NOTICE", "1")
    if fmt == "md":
        from unstructured.partition.md import partition_md

        return partition_md
    if fmt == "text":
        from unstructured.partition.text import partition_text

        return partition_text
    if fmt == "html":
        from unstructured.partition.html import partition_html

        return partition_html
    if fmt == "pdf":
        from unstructured.partition.pdf import partition_pdf

        return partition_pdf
    if fmt == "docx":
        from unstructured.partition.docx import partition_docx

        return partition_docx
    raise AssertionError(fmt)


def _partition(fn: Callable[..., list[Any]], failure: str, **kwargs: Any) -> list[Any]:
    try:
        # languages given: otherwise unstructured runs language detection and logs about it.
        return fn(languages=["eng"], **kwargs)
    except ParseError:
        raise
    except Exception as e:  # a parser failure on one file must not end the run
        if _spacy_model_missing(e):
            raise ParseError(f"{failure}: {SPACY_MODEL_HINT} ({_short(e)})") from e
        raise ParseError(f"{failure}: {_short(e)}") from e


# unstructured sorts text into titles and narrative with spaCy's en_core_web_sm; when spaCy cannot
# find it (by its package metadata), it tries to download and install it, which offline fails on
# every document with an error that does not say so (e.g. "No module named 'installer'").
SPACY_MODEL_HINT = ("unstructured could not load the spaCy model en_core_web_sm and could not install it "
                    "(it downloads it from GitHub); install it where rag runs: scripts/build_spacy_stub.sh "
                    "makes an offline stand-in, `python -m spacy download en_core_web_sm` the real one")


def _spacy_model_missing(e: BaseException) -> bool:
    """Whether a parser failure came from unstructured loading or installing its spaCy model."""
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name in ("_load_spacy_model", "_install_spacy_model"):
                return True
            tb = tb.tb_next
        err = err.__cause__ or err.__context__
    return False


def _to_elements(raw: list[Any], heuristic_titles: bool) -> list[Element]:
    elements: list[Element] = []
    for el in raw:
        kind = getattr(el, "category", type(el).__name__)
        text = (getattr(el, "text", "") or "").strip()
        if kind in _SKIPPED_KINDS or not text:
            continue
        if heuristic_titles and kind == "Title" and _is_sentence(text):
            # In plain text and PDFs, "Title" is a guess from line shape; without a POS
            # tagger (the offline spaCy stub) every short line looks like one. A line that
            # ends like a sentence or runs long is body text, not a heading.
            kind = "NarrativeText"
        metadata = getattr(el, "metadata", None)
        if kind == "Table":
            # Rows and the header, not every cell joined by spaces (ingest/table_text.py).
            text = markdown_table(getattr(metadata, "text_as_html", None)) or text
        page = getattr(metadata, "page_number", None)
        elements.append(Element(kind=kind, text=text, page=page))
    return elements


def _is_sentence(text: str) -> bool:
    return text.rstrip().endswith((".", "!", "?", ";", ":")) or len(text.split()) > 20


def _title(elements: list[Element], path: Path, heuristic_titles: bool) -> str:
    # Where headings are marked up (md, html, docx), the first heading near the top names
    # the document. Where they are guessed (txt, pdf), only a heading that opens it does.
    window = elements[:1] if heuristic_titles else elements[:_TITLE_WITHIN]
    for el in window:
        if el.kind == "Title":
            return el.text
    return path.stem


def _short(e: BaseException) -> str:
    """A one-line, bounded version of an exception message."""
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."
