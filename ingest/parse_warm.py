"""Warm the document parsers of a process: import them and run each once on a tiny document.

A fresh process pays ~5 s importing unstructured's partitioners and ~0.7 s more on its first text
and first PDF (measured on the 2-core dev machine: 10.4 s for the first source of each format,
then 6–43 ms a source), so a pool of parse workers that each start cold spends its first seconds,
all workers at once on the same cores, importing. `ingest.parse_pool` warms one forkserver
process instead and forks its workers from it, warm.
"""

from __future__ import annotations

import io
import logging
import time

log = logging.getLogger(__name__)

FORMATS = ("text", "md", "html", "pdf", "docx")


def tiny_pdf(text: str = "Warm up.") -> bytes:
    """A one-page PDF showing `text` in Helvetica (a valid file: xref offsets are exact)."""
    stream = f"BT /F1 12 Tf 20 50 Td ({text}) Tj ET".encode("latin-1")
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.writelines(b"%010d 00000 n \n" % offset for offset in offsets)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def warm_parsers() -> list[str]:
    """Import every partitioner and parse a tiny text, Markdown and PDF; the formats that warmed.

    Best effort: a format whose parser is missing or fails here is left cold (its first real
    source reports the problem as usual).
    """
    from ingest.parse import _partition, _partitioner

    started = time.perf_counter()
    warmed = []
    samples = {"text": {"text": "Warm up.\n\nA second paragraph."}, "md": {"text": "# Warm\n\nup."},
               "pdf": {"file": io.BytesIO(tiny_pdf()), "strategy": "fast"}}
    for fmt in FORMATS:
        try:
            partition = _partitioner(fmt)
            if fmt in samples:
                _partition(partition, f"warm-up {fmt}", **samples[fmt])
        except Exception as e:  # noqa: BLE001 - a cold parser is slower, never wrong
            log.debug("parser %s not warmed: %s", fmt, e)
            continue
        warmed.append(fmt)
    log.debug("warmed parsers %s in %.1f s", warmed, time.perf_counter() - started)
    return warmed
