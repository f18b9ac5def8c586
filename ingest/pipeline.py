"""Ingest: walk → (skip unchanged) → parse → chunk → embed (batched) → write; incremental.

Each document is written in its own catalog transaction, so an interrupted run keeps every
document it finished and the previous version of the one it was on. A source that fails
(corrupt, binary, unreadable...) is reported with its reason and leaves its stored version,
if any, untouched; only documents that are really gone from an ingested root are deleted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ingest.chunk import Chunker
from ingest.parse import parse_item
from ingest.sources import SourceItem, SourceProblem, scan_roots, walk_sources
from rag.errors import IngestError
from rag.types import Chunk, Document
from retrieval.base import CollectionStore

log = logging.getLogger(__name__)

# Progress callback: (stage, done, total). Stages: "scan", "ingest".
ProgressFn = Callable[[str, int, int], None]


@dataclass
class Problem:
    key: str
    reason: str


@dataclass
class IngestReport:
    """What a run did; `ok` is False when any source failed."""

    added: int = 0
    updated: int = 0
    unchanged: int = 0
    acl_updated: int = 0
    deleted: int = 0
    chunks_written: int = 0
    tokens_embedded: int = 0
    problems: list[Problem] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "added": self.added, "updated": self.updated,
            "unchanged": self.unchanged, "acl_updated": self.acl_updated,
            "deleted": self.deleted, "chunks_written": self.chunks_written,
            "tokens_embedded": self.tokens_embedded,
            "problems": [{"source": p.key, "reason": p.reason} for p in self.problems],
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


@dataclass
class _Pending:
    doc: Document
    acl: frozenset[str]
    chunks: list[Chunk]
    is_new: bool


class IngestPipeline:
    """Brings a collection in line with the sources under some paths."""

    def __init__(self, index: CollectionStore, embed: Callable[[Sequence[str]], np.ndarray],
                 chunker: Chunker, batch_chunks: int = 256) -> None:
        self.index = index
        self.embed = embed
        self.chunker = chunker
        self.batch_chunks = batch_chunks

    def run(self, paths: Sequence[Path], progress: ProgressFn | None = None) -> IngestReport:
        """Ingest every supported source under `paths`.

        Raises:
            ConfigError: a path does not exist (nothing is changed then).
        """
        report = IngestReport()
        clock = _Clock(report.seconds)
        with clock("scan"):
            roots = scan_roots(paths)
            items = list(walk_sources(roots))
            stored = self.index.document_states()
        seen: set[str] = set()
        failed_files: set[str] = set()  # files with a bad part: keep their stored records
        pending: list[_Pending] = []
        total = len(items)
        for n, item in enumerate(items, 1):
            if isinstance(item, SourceProblem):
                report.problems.append(Problem(item.key, item.reason))
                seen.add(item.key)
                failed_files.add(str(item.path))
            else:
                seen.add(item.key)
                self._one(item, stored, report, pending, clock)
                if sum(len(p.chunks) for p in pending) >= self.batch_chunks:
                    self._flush(pending, report, clock)
            if progress:
                progress("ingest", n, total)
        self._flush(pending, report, clock)

        with clock("delete"):
            for key in sorted(stored):
                if key in seen or not _under_any(key, roots):
                    continue
                if any(key.startswith(f + "#") for f in failed_files):
                    continue
                self.index.delete_document(key)
                report.deleted += 1
        with clock("save"):
            self.index.save()
        return report

    def _one(self, item: SourceItem, stored: dict, report: IngestReport,
             pending: list[_Pending], clock: _Clock) -> None:
        old = stored.get(item.key)
        if old is not None and old.content_hash == item.content_hash:
            if old.acl != item.acl:
                with clock("write"):
                    self.index.set_acl(item.key, item.acl)
                report.acl_updated += 1
            else:
                report.unchanged += 1
            return
        try:
            with clock("parse"):
                doc = parse_item(item)
            with clock("chunk"):
                chunks = self.chunker.chunk(doc)
        except IngestError as e:
            report.problems.append(Problem(item.key, str(e)))
            return
        except Exception as e:  # a parser bug must not end the run; say what it was
            log.debug("parse failed for %s", item.key, exc_info=True)
            report.problems.append(Problem(item.key, f"{type(e).__name__}: {e}"))
            return
        if not chunks:
            report.problems.append(Problem(item.key, "no text extracted"))
            return
        pending.append(_Pending(doc, item.acl, chunks, is_new=old is None))

    def _flush(self, pending: list[_Pending], report: IngestReport, clock: _Clock) -> None:
        if not pending:
            return
        texts = [c.text for p in pending for c in p.chunks]
        with clock("embed"):
            vectors = self.embed(texts)
        offset = 0
        with clock("write"):
            for p in pending:
                n = len(p.chunks)
                self.index.replace_document(p.doc, p.acl, p.chunks, vectors[offset:offset + n])
                offset += n
                report.chunks_written += n
                report.tokens_embedded += sum(c.num_tokens for c in p.chunks)
                if p.is_new:
                    report.added += 1
                else:
                    report.updated += 1
        pending.clear()


def _under_any(key: str, roots: Sequence[Path]) -> bool:
    path = key.split("#", 1)[0]
    for root in roots:
        r = str(root)
        if path == r or path.startswith(r.rstrip(os.sep) + os.sep):
            return True
    return False


class _Clock:
    """Adds the time spent in each stage to a dict."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self._stage = ""
        self._t = 0.0

    def __call__(self, stage: str) -> _Clock:
        self._stage = stage
        return self

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._stage] = self.seconds.get(self._stage, 0.0) + time.perf_counter() - self._t
