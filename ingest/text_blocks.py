"""Read a large text or Markdown file as blocks of whole paragraphs, with bounded memory.

unstructured partitions a text whole: a 50 MB file became ~1.8 GB of Python objects before the
first chunk was embedded. Its text and Markdown partitioners only look at one paragraph at a time
(paragraphs end at a blank line), so partitioning blocks cut at blank lines gives the elements of
the whole file, one block in memory at a time. Markdown is only cut before a line that cannot
continue the block above it (not indented, no list, quote, table, HTML or fence marker) and outside
fenced code. A paragraph longer than `MAX_BLOCK_CHARS` (no blank line for megabytes) is cut at a
space: the one place where the blocks differ from the whole file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from rag.errors import ParseError

READ_BYTES = 1 << 20
BLOCK_CHARS = 1 << 20  # blocks are cut at the first boundary past this many characters
MAX_BLOCK_CHARS = 4 << 20  # ... and forcibly at a space when no boundary comes before this

# A blank line (whitespace only) ends a paragraph in both of unstructured's text groupers; in a
# text without blank lines (its "new-line" grouping) every line is a paragraph.
_TEXT_BOUNDARY = re.compile(r"\n[^\S\n]*\n")
_LINE_BOUNDARY = re.compile(r"\n")
# In Markdown, also the next line must start a new block on its own.
_MD_BOUNDARY = re.compile(r"\n[^\S\n]*\n(?=[^\s\-*+>|`~<0-9=\[])")
_MD_FENCE = re.compile(r"^[ ]{0,3}(```|~~~)", re.MULTILINE)


def check_text_file(path: Path) -> None:
    """Read the whole file once and raise what decoding it whole would, keeping nothing.

    The caller sniffs the first bytes for binary content as for any text file; this finds what
    only a full read can (a NUL or bad UTF-8 megabytes in), before any of it is embedded.

    Raises:
        ParseError: a NUL byte, or invalid UTF-8 (with the file offset), as the whole-file path says.
    """
    for text in decoded_pieces(path):
        if "\x00" in text:
            raise ParseError("binary content in a text file")


def decoded_pieces(path: Path) -> Iterator[str]:
    """The file's text, decoded strictly as UTF-8 (a leading BOM dropped), READ_BYTES at a time.

    Raises:
        ParseError: invalid UTF-8, with its byte offset in the file; the file cannot be read.
    """
    offset = 0  # file offset of `carry`'s first byte
    carry = b""
    try:
        with path.open("rb") as f:
            while True:
                data = f.read(READ_BYTES)
                final = not data
                buf = carry + data
                if offset == 0 and buf.startswith(b"\xef\xbb\xbf"):
                    buf, offset = buf[3:], 3
                try:
                    text = buf.decode("utf-8")
                    carry = b""
                except UnicodeDecodeError as e:
                    # A character cut by the read boundary is completed by the next read.
                    if final or e.end < len(buf) or len(buf) - e.start > 3:
                        raise ParseError(f"invalid UTF-8 at byte {offset + e.start} "
                                         "(convert the file to UTF-8, e.g. with iconv)") from None
                    text, carry = buf[:e.start].decode("utf-8"), buf[e.start:]
                offset += len(buf) - len(carry)
                if text:
                    yield text
                if final:
                    return
    except OSError as e:
        raise ParseError(f"cannot read file: {e.strerror or e}") from e


def text_blocks(path: Path, markdown: bool, lines_are_paragraphs: bool = False) -> Iterator[str]:
    """The file's text in consecutive blocks that each end at a paragraph boundary (see module doc).

    Args:
        lines_are_paragraphs: plain text grouped by lines (unstructured's new_line_grouper):
            any line end is a boundary.

    Joined, the blocks are exactly the file's text. Raises ParseError as `decoded_pieces`.
    """
    boundary = _MD_BOUNDARY if markdown else _LINE_BOUNDARY if lines_are_paragraphs else _TEXT_BOUNDARY
    fences_open = False  # inside fenced code at the start of `buf` (Markdown)
    buf = ""
    for piece in decoded_pieces(path):
        buf += piece
        while len(buf) >= BLOCK_CHARS:
            cut = _next_cut(buf, boundary, fences_open if markdown else None)
            if cut is None:
                if len(buf) < MAX_BLOCK_CHARS:
                    break  # read on: the boundary may be in the next piece
                cut = _forced_cut(buf)
            block, buf = buf[:cut], buf[cut:]
            if markdown:
                fences_open ^= len(_MD_FENCE.findall(block)) % 2 == 1
            yield block
    if buf:
        yield buf


def _next_cut(buf: str, boundary: re.Pattern[str], fences_open: bool | None) -> int | None:
    start = BLOCK_CHARS - 1
    while (m := boundary.search(buf, start)) is not None:
        if m.end() > MAX_BLOCK_CHARS:
            return None
        if fences_open is None or (len(_MD_FENCE.findall(buf, 0, m.start())) % 2 == 1) == fences_open:
            return m.end()
        start = m.end()
    return None


def _forced_cut(buf: str) -> int:
    space = max(buf.rfind(" ", 0, MAX_BLOCK_CHARS), buf.rfind("\n", 0, MAX_BLOCK_CHARS))
    return space + 1 if space > 0 else MAX_BLOCK_CHARS


def first_lines(path: Path, count: int) -> str:
    """The first `count` lines of the file's text (each with its newline), or all of it."""
    out: list[str] = []
    found = 0
    for piece in decoded_pieces(path):
        n = piece.count("\n")
        if found + n >= count:
            end = -1
            for _ in range(count - found):
                end = piece.index("\n", end + 1)
            out.append(piece[:end + 1])
            break
        out.append(piece)
        found += n
    return "".join(out)

