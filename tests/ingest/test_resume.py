"""A `rag ingest` killed with SIGKILL at random moments resumes to exactly an uninterrupted run's collection.

Two phases over one corpus: a first ingest, then edits (changed, new and deleted files, an
ACL-only change through a sidecar, JSONL records changed, dropped and re-permissioned). In
each phase the job is killed during model load and at random points of its writes (seeded),
re-run until it finishes, and compared with an uninterrupted ingest: same documents, hashes,
ACLs, chunk texts, vectors and search results. A document whose content did not change keeps
its catalog row from one run to the next: finished documents are never re-embedded.
A kill inside a big document (its chunks span several embed batches) loses at most the batch
being embedded: the others were staged, and the document appears only when it is whole.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from permissions.models import Principal
from rag.pipeline import Rag
from rag.settings import load_settings
from retrieval.stores.embedded.catalog import Catalog

pytestmark = pytest.mark.slow  # seven `rag ingest` processes, each loading torch: minutes

RAG = [sys.executable, "-c", "from rag.cli import main; main()"]
# `rag`, stopped for a minute right after it logs that batch 2 was embedded, before anything of that
# batch is written: a kill there lands in that window on any machine, not only when the test's
# reading of the log outpaces the write (on a loaded CI machine it once did not).
RAG_PAUSED_AFTER_BATCH_2 = [sys.executable, "-c", """
import time
from ingest import batch_commit
from rag.cli import main
logged = batch_commit.log.info
def info(msg, *args):
    logged(msg, *args)
    if msg.startswith("embedded batch") and args and args[0] == 2:
        time.sleep(60)
batch_commit.log.info = info
main()
"""]
# Chunks per embed call, committed after each (the CPU default is 256): smaller here, so the
# big-document test embeds two batches of a shorter document, and each of its runs is quicker.
BATCH_CHUNKS = 64
WORDS = ("centrifuge freezer buffer reagent microscope booking cluster node queue backup quota "
         "sample plate incubator sequencer pipette").split()
QUERIES = ["Where is the freezer?", "microscope booking", "cluster queue quota", "record about plates"]
PRINCIPALS = [Principal("root"), Principal("x", frozenset({"alpha"})), Principal("y", frozenset({"beta"})),
              Principal("carl")]

Snapshot = dict[str, tuple[int, str]]  # key -> (document row id, content hash)


def _sentence(rng: random.Random, i: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(12)) + f" (item {i})."


def _write_corpus(root: Path, rng: random.Random) -> None:
    for group in ("alpha", "beta"):
        (root / group).mkdir(parents=True)
        (root / group / ".rag-acl.toml").write_text(f'allow = ["group:{group}"]\n')
    (root / "open").mkdir()
    for i in range(100):
        d = root / ("alpha", "beta", "open")[i % 3] / f"sub{i % 4}"
        d.mkdir(exist_ok=True)
        suffix = ".md" if i % 2 else ".txt"
        body = " ".join(_sentence(rng, i) for _ in range(rng.randint(1, 4)))
        (d / f"doc{i:03d}{suffix}").write_text(f"# Document {i}\n\n{body}\n" if suffix == ".md" else body + "\n")
    records = [{"id": f"r{i}", "text": f"Record {i} about plates: {_sentence(rng, i)}"}
               | ({"acl": ["group:alpha", "user:carl"]} if i % 5 == 0 else {}) for i in range(50)]
    (root / "beta" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _edit_corpus(root: Path, rng: random.Random) -> None:
    files = sorted(p for p in root.rglob("doc*") if p.is_file())
    for p in files[:20]:
        p.unlink()
    for p in files[20:45]:
        p.write_text(p.read_text() + _sentence(rng, 1000) + "\n")
    for i in range(10):
        (root / "open" / f"new{i}.md").write_text(f"# New {i}\n\n{_sentence(rng, 2000 + i)}\n")
    (root / "beta" / ".rag-acl.toml").write_text('allow = ["group:beta", "user:carl"]\n')  # ACL-only
    path = root / "beta" / "records.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()][10:]  # r0..r9 vanish
    for r in records[:10]:
        r["text"] += " Revised."
    for r in records[10:20]:
        r["acl"] = ["user:carl"]  # ACL-only: the record hash leaves the ACL out
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _snapshot(catalog_path: Path) -> Snapshot:
    if not catalog_path.exists():
        return {}
    with sqlite3.connect(f"file:{catalog_path}?mode=ro", uri=True, timeout=30) as db:
        try:
            rows = db.execute("SELECT key, id, content_hash FROM documents WHERE collection = 'default'")
            return {k: (i, h) for k, i, h in rows}
        except sqlite3.OperationalError:  # killed before the schema was made
            return {}


def _count(catalog_path: Path, sql: str, args: tuple = ()) -> int:
    try:
        with sqlite3.connect(f"file:{catalog_path}?mode=ro", uri=True, timeout=30) as db:
            return int(db.execute(sql, args).fetchone()[0])
    except sqlite3.Error:
        return 0


def _run(home: Path, corpus: Path, kill_when: Callable[[], bool] | None = None,
         kill_after: float | None = None) -> dict | None:
    """One `rag ingest --json`; SIGKILLed once `kill_when()` holds or `kill_after` seconds pass.

    Returns the JSON summary, or None when the process was killed.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    proc = subprocess.Popen(RAG + ["--home", str(home), "ingest", str(corpus), "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    while proc.poll() is None:
        due = kill_after is not None and time.monotonic() - started >= kill_after
        if due or (kill_when is not None and kill_when()):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return None
        assert time.monotonic() - started < 300, "ingest hangs"
        time.sleep(0.005)
    out, err = proc.communicate()
    assert proc.returncode in (0, 1), err
    return json.loads(out)


def _check_no_rewrite(before: Snapshot, after: Snapshot) -> None:
    """A document with the same content hash keeps its row: it was not embedded and written again."""
    for key, (row, content_hash) in before.items():
        if key in after and after[key][1] == content_hash:
            assert after[key][0] == row, f"{key} was rewritten although its content did not change"


def _resume_until_done(home: Path, corpus: Path, kills: list[Callable[[], bool] | float]) -> tuple[dict, list]:
    """Run with each kill in turn, then to the end; returns the final summary and the snapshots."""
    catalog = home / "catalog.sqlite"
    snapshots = [_snapshot(catalog)]
    for kill in kills:
        summary = _run(home, corpus, kill_after=kill) if isinstance(kill, float) else _run(home, corpus, kill)
        snapshots.append(_snapshot(catalog))
        _check_no_rewrite(snapshots[-2], snapshots[-1])
        if summary is not None:  # finished before the kill came
            return summary, snapshots
    summary = _run(home, corpus)
    assert summary is not None
    snapshots.append(_snapshot(catalog))
    _check_no_rewrite(snapshots[-2], snapshots[-1])
    return summary, snapshots


def _assert_same_collection(home: Path, reference: Rag) -> None:
    catalog = Catalog(home / "catalog.sqlite")
    got, want = catalog.dump("default"), reference.catalog.dump("default")
    assert [{k: v for k, v in r.items() if k != "vector"} for r in got] == \
           [{k: v for k, v in r.items() if k != "vector"} for r in want]
    for g, w in zip(got, want, strict=True):
        assert np.allclose(g["vector"], w["vector"], atol=1e-5), g["key"]
    # The index file of the final version was saved (no rebuild needed), and nothing else is left.
    version = catalog.version("default")
    assert sorted(p.name for p in (home / "indexes").iterdir()) == [f"default.v{version}.faiss"]
    catalog.close()
    resumed = Rag(load_settings(home=home, rerank=False))
    try:
        for principal in PRINCIPALS:
            for question in QUERIES:
                for mode in ("dense", "keyword"):
                    a = resumed.query(question, principal, k=5, generate=False, mode=mode).hits
                    b = reference.query(question, principal, k=5, generate=False, mode=mode).hits
                    assert [(h.document_key, h.chunk_index) for h in a] == \
                           [(h.document_key, h.chunk_index) for h in b], (question, principal, mode)
                    assert np.allclose([h.score for h in a], [h.score for h in b], atol=1e-4)
    finally:
        resumed.close()


def test_killed_ingest_resumes_to_the_uninterrupted_result(tmp_path: Path, monkeypatch) -> None:
    # Catalog rows commit once per embed batch (a transaction of many documents): batches of 16
    # chunks give the kills below about ten commits to land between.
    monkeypatch.setenv("RAG_INGEST_BATCH_CHUNKS", "16")  # this process and the `rag` ones
    rng = random.Random(1234)
    corpus = tmp_path / "corpus"
    _write_corpus(corpus, rng)
    home = tmp_path / "killed"
    catalog = home / "catalog.sqlite"
    reference = Rag(load_settings(home=tmp_path / "reference", rerank=False))

    # Phase 1: a first ingest of 150 documents.
    assert reference.ingest([corpus]).added == 150
    thresholds = sorted(rng.sample(range(10, 140), 2))
    kills = [rng.uniform(0.5, 1.5)] + [
        (lambda n=n: _count(catalog, "SELECT COUNT(*) FROM documents") >= n) for n in thresholds]
    summary, snapshots = _resume_until_done(home, corpus, kills)
    partial = [len(s) for s in snapshots[1:-1]]
    assert any(0 < n < 150 for n in partial), f"no kill landed mid-ingest: {partial}"
    before_last = snapshots[-2]
    assert summary["unchanged"] == len(before_last) and summary["added"] == 150 - len(before_last)
    _assert_same_collection(home, reference)

    # Phase 2: edits, new files, deletions, ACL-only changes, JSONL records changed and dropped.
    _edit_corpus(corpus, rng)
    changes = reference.ingest([corpus])
    assert changes.deleted == 30 and changes.acl_updated > 20 and changes.updated == 35, changes.as_dict()
    gone = [k for k in snapshots[-1] if not Path(k.split("#")[0]).exists() or k.endswith(tuple(
        f"#r{i}" for i in range(10)))]
    assert len(gone) == 30
    start = time.time()
    writes = rng.sample(range(5, changes.added + changes.updated + changes.acl_updated), 1)
    marks = ",".join("?" * len(gone))
    kills = [
        (lambda n=n: _count(catalog, "SELECT COUNT(*) FROM documents WHERE updated_at > ?", (start,)) >= n)
        for n in writes] + [
        # during the deletions, if a poll catches them
        lambda: 0 < _count(catalog, f"SELECT COUNT(*) FROM documents WHERE key IN ({marks})", tuple(gone)) < 30]
    phase_start = snapshots[-1]
    summary, snapshots = _resume_until_done(home, corpus, kills)
    _check_no_rewrite(phase_start, snapshots[-1])  # unchanged and ACL-only documents kept their rows
    _assert_same_collection(home, reference)
    reference.close()


def _big_document(rng: random.Random, parts: int) -> str:
    """Markdown of about 2 x `parts` chunks at the default 200-token cap."""
    return "# Lab handbook\n\n" + "".join(
        f"## Part {i}\n\n" + " ".join(_sentence(rng, i) for _ in range(12)) + "\n\n" for i in range(parts))


def test_killed_late_in_a_batch_of_a_big_document_redoes_at_most_that_batch(tmp_path: Path, monkeypatch) -> None:
    """A kill after a batch was embedded but before it was committed: the restart embeds that batch
    again and nothing else, counted by the chunks each run says it embedded, not by time."""
    monkeypatch.setenv("RAG_INGEST_BATCH_CHUNKS", str(BATCH_CHUNKS))  # this process and the `rag` ones
    rng = random.Random(99)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(_sentence(rng, 1) + "\n")
    (corpus / "handbook.md").write_text(_big_document(rng, 45))
    reference = Rag(load_settings(home=tmp_path / "reference", rerank=False))
    total = reference.ingest([corpus]).chunks_written
    assert total > BATCH_CHUNKS + 10  # two batches

    home = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    proc = subprocess.Popen(RAG_PAUSED_AFTER_BATCH_2 + ["--home", str(home), "--verbose", "ingest", str(corpus),
                                                        "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    embedded = []  # (batch, chunks) as the killed run logged them
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"embedded batch (\d+): (\d+) chunks", line)
        if m:
            embedded.append((int(m.group(1)), int(m.group(2))))
            if m.group(1) == "2":  # embedded, not yet committed: the latest moment of batch 2
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before batch 2: no kill landed"
    key = str((corpus / "handbook.md").resolve())
    assert key not in _snapshot(home / "catalog.sqlite")  # half a document is never visible
    staged = _count(home / "staging" / "default.sqlite", "SELECT COUNT(*) FROM staged_chunks")
    # Batch 1 was committed (a.txt's chunk to the collection, the rest to staging), batch 2 was not.
    assert _count(home / "catalog.sqlite", "SELECT COUNT(*) FROM chunks") == 1
    assert staged + 1 == embedded[0][1] == BATCH_CHUNKS

    summary = _run(home, corpus)
    assert summary is not None and summary["ok"] and summary["unchanged"] == 1  # a.txt, written before
    assert summary["chunks_written"] == total - 1
    assert summary["chunks_resumed"] == staged
    redone = sum(n for _, n in embedded) + summary["chunks_embedded"] - total
    assert redone == embedded[1][1] <= BATCH_CHUNKS, (embedded, summary["chunks_embedded"], total)
    assert not (home / "staging" / "default.sqlite").exists()
    _assert_same_collection(home, reference)
    reference.close()
