"""BEIR-style benchmark folders: corpus.jsonl, queries.jsonl and qrels/SPLIT.tsv.

Public IR benchmarks (BEIR, MTEB retrieval sets) ship in this layout. The corpus is ingested
as the project's JSONL records (`write_records`): one record per BEIR document, readable by
everyone (a public benchmark has no permissions), so labels are `corpus.jsonl#DOC-ID`.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from rag.errors import ConfigError
from rag.experiments.questions import Question, QuestionSet

if TYPE_CHECKING:
    from rag.pipeline import Rag

RECORDS_FILE = "corpus.jsonl"  # the name of the records file, so labels read corpus.jsonl#ID
BEIR_USER = "reader"  # who asks a benchmark's questions: anyone (the records are public)


def is_beir_folder(path: Path) -> bool:
    return (path / "corpus.jsonl").is_file() and (path / "queries.jsonl").is_file() and (path / "qrels").is_dir()


def record_label(doc_id: str) -> str:
    """How a BEIR document is labelled once ingested from `write_records`' file."""
    return f"{RECORDS_FILE}#{doc_id}"


def read_beir(folder: str | Path, split: str = "test") -> QuestionSet:
    """The queries of one split that have at least one relevant document (qrels score > 0).

    Relevance grades (the qrels scores) are kept for nDCG. The set's `corpus` is the BEIR
    folder; ingest it with `write_records` first (`rag eval` does).

    Raises:
        ConfigError: a file is missing or malformed (named, with its line).
    """
    folder = Path(folder)
    qrels_path = folder / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        splits = sorted(p.stem for p in (folder / "qrels").glob("*.tsv"))
        raise ConfigError(f"{qrels_path} does not exist; splits here: {', '.join(splits) or 'none'}")
    grades: dict[str, dict[str, int]] = {}
    with qrels_path.open(newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.reader(f, delimiter="\t"), 1):
            if not row or (lineno == 1 and not _is_int(row[-1])):  # the header line
                continue
            if len(row) < 3 or not _is_int(row[2]):
                raise ConfigError(f"{qrels_path}, line {lineno}: expected query-id, corpus-id, score")
            if int(row[2]) > 0:
                grades.setdefault(row[0], {})[record_label(row[1])] = int(row[2])
    questions = []
    for lineno, obj in _jsonl(folder / "queries.jsonl"):
        qid = str(obj.get("_id", ""))
        if qid in grades:
            if not isinstance(obj.get("text"), str) or not obj["text"].strip():
                raise ConfigError(f"{folder / 'queries.jsonl'}, line {lineno}: query {qid!r} has no text")
            questions.append(Question(id=qid, text=obj["text"], user=BEIR_USER,
                                      sources=tuple(grades[qid]), grades=grades[qid]))
    return QuestionSet(questions, folder.name, corpus=folder)


def write_records(folder: str | Path, out_dir: str | Path) -> Path:
    """Write a BEIR corpus as JSONL records that `rag ingest` reads; returns the file.

    A document with no text is stored by its title (ingest refuses empty text); one with
    neither is skipped. The file is rewritten only when its content changes, so a later
    ingest finds it unchanged.
    """
    folder, out_dir = Path(folder), Path(out_dir)
    lines = []
    for _, obj in _jsonl(folder / "corpus.jsonl"):
        title = (obj.get("title") or "").strip() or None
        text = (obj.get("text") or "").strip() or title
        if text:
            lines.append(json.dumps({"id": str(obj["_id"]), "text": text, "title": title, "acl": ["public"]}))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / RECORDS_FILE
    content = "\n".join(lines) + "\n"
    if not out.is_file() or out.read_text(encoding="utf-8") != content:
        out.write_text(content, encoding="utf-8")
    return out


def _jsonl(path: Path):
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from e
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}, line {lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict) or "_id" not in obj:
                raise ConfigError(f"{path}, line {lineno}: expected an object with an '_id'")
            yield lineno, obj


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def ingest_beir(rag: Rag, qset: QuestionSet, collection: str | None = None,
                progress: bool | None = None) -> tuple[Path, str]:
    """Ingest a BEIR set's corpus into its own collection; returns (labels' root, collection).

    The records go to HOME/experiments/beir-NAME/corpus.jsonl (owner-only, as HOME), and the
    collection is `beir-NAME` unless named: a benchmark never mixes into a lab's collection.
    Re-running is incremental (unchanged records are skipped).
    """
    from rag.private_files import private_mkdir

    if qset.corpus is None:
        raise ConfigError(f"question set {qset.name!r} brings no corpus to ingest")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", qset.name)[:50] or "set"
    out_dir = private_mkdir(rag.settings.home / "experiments" / f"beir-{safe}")
    records = write_records(qset.corpus, out_dir)
    collection = collection or f"beir-{safe}"
    report = rag.ingest([records], collection, progress=progress)
    if not report.ok:
        raise ConfigError(f"ingesting {records} failed: {[str(p) for p in report.problems[:3]]}")
    return out_dir, collection
