"""Parsing in worker processes (`ingest_workers` > 1) stores exactly what parsing in process stores."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from ingest import parse_pool
from ingest.chunk import Chunker, ChunkingConfig
from ingest.parse_pool import ParseFailure, failure_reason
from ingest.pipeline import IngestPipeline
from rag.errors import ParseError
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from tests.ingest.test_chunk_batched import fake_embed

LAB_DOCS = Path(__file__).resolve().parents[2] / "examples" / "lab-docs"


def _ingest(corpus: Path, work: Path, tokenizer, workers: int, chunk_batch: int = 8
            ) -> tuple[list[dict], list[tuple[str, str]], list[tuple[str, str]], IngestPipeline]:
    """(catalog rows, problems, ACL problems) of one run, all in the order the run made them."""
    catalog = Catalog(work / f"catalog{workers}.sqlite")
    info = catalog.create_collection("c", "fake", "fp", 8, ChunkingConfig().as_dict())
    store = EmbeddedCollection(catalog, info, work / f"indexes{workers}")
    pipeline = IngestPipeline(store, fake_embed, Chunker(tokenizer, ChunkingConfig()), batch_chunks=16,
                              chunk_batch=chunk_batch, workers=workers)
    report = pipeline.run([corpus])
    rows = [{k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in r.items()} for r in catalog.dump("c")]
    catalog.close()
    problems = [(str(Path(p.key).relative_to(corpus)), p.reason) for p in report.problems]
    acl = [(str(Path(a.source).relative_to(corpus)), a.error) for a in report.acl_errors]
    return rows, problems, acl, pipeline


def _broken_corpus(root: Path) -> None:
    """Sources that fail in each way a parser reports: binary, empty, corrupt PDF and DOCX, bad UTF-8."""
    (root / "broken").mkdir()
    (root / "broken" / "binary.txt").write_bytes(b"\x00\x01binary\xff" * 50)
    (root / "broken" / "empty.md").write_text("")
    (root / "broken" / "corrupt.pdf").write_bytes(b"%PDF-1.4\nnot really a pdf\n")
    (root / "broken" / "corrupt.docx").write_bytes(b"PK\x03\x04 not a zip")
    (root / "broken" / "latin1.md").write_bytes("# Caf\xe9\n\nna\xefve text\n".encode("latin-1"))
    (root / "broken" / "no-acl").mkdir()
    (root / "broken" / "no-acl" / ".rag-acl.toml").write_text("allow = [")  # unreadable sidecar: fail closed
    (root / "broken" / "no-acl" / "note.md").write_text("# Note\n\nreadable by nobody until fixed\n")


@pytest.mark.slow
def test_lab_docs_store_the_same_rows_and_problems_with_two_workers(tokenizer, tmp_path) -> None:
    pytest.importorskip("unstructured")
    corpus = tmp_path / "corpus"
    shutil.copytree(LAB_DOCS, corpus)
    _broken_corpus(corpus)
    rows1, problems1, acl1, _ = _ingest(corpus, tmp_path, tokenizer, workers=1)
    rows2, problems2, acl2, _ = _ingest(corpus, tmp_path, tokenizer, workers=2)
    assert len(rows1) > 50
    assert rows2 == rows1  # keys, hashes, ACLs, titles, chunk texts, headings, vectors, in key order
    assert problems2 == problems1  # the same sources, the same reasons, in the walk's order
    assert acl2 == acl1 and acl1  # the unreadable sidecar: kept readable by nobody, said the same way
    assert {name.split("/")[0] for name, _ in problems1} == {"broken"}, problems1
    assert len(problems1) >= 4, problems1


def test_two_workers_keep_the_walks_order_and_a_window_in_flight(tokenizer, tmp_path, monkeypatch) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / ".rag-acl.toml").write_text('allow = ["public"]\n')
    for i in range(30):
        (corpus / f"d{i:02d}.md").write_text(f"# Doc {i}\n\n" + f"word{i} " * (5 + 7 * i) + "\n")
    (corpus / "d07x.txt").write_bytes(b"\x00\x01binary\xff" * 50)
    (corpus / "d21x.md").write_text("")
    jobs: list = []  # [future, taken] of every submit
    most = [0]  # the most sources submitted and not yet taken back (as a result, or cancelled)
    submit, result = parse_pool.ParsePool.submit, parse_pool.ParsePool.result

    def counted_submit(self, item):
        job = submit(self, item)
        jobs.append([job, False])
        most[0] = max(most[0], sum(not taken and not f.cancelled() for f, taken in jobs))
        return job

    def counted_result(self, item, job):
        next(j for j in jobs if j[0] is job)[1] = True
        return result(self, item, job)

    monkeypatch.setattr(parse_pool.ParsePool, "submit", counted_submit)
    monkeypatch.setattr(parse_pool.ParsePool, "result", counted_result)
    rows1, problems1, _, _ = _ingest(corpus, tmp_path, tokenizer, workers=1, chunk_batch=4)
    rows2, problems2, _, _ = _ingest(corpus, tmp_path, tokenizer, workers=2, chunk_batch=4)
    assert rows2 == rows1 and len(rows1) >= 30
    assert problems2 == problems1 == [("d07x.txt", problems1[0][1]), ("d21x.md", "empty file")], problems1
    assert 1 < most[0] <= 4  # never more than chunk_batch sources handed to the workers at once


def test_a_failure_in_a_worker_is_reported_as_in_process() -> None:
    assert failure_reason(ParseError("corrupt PDF: x")) == "corrupt PDF: x"
    assert failure_reason(KeyError("y")) == "KeyError: 'y'"
    # What a worker sends back reads the same, whatever the original exception could pickle.
    assert failure_reason(ParseFailure(failure_reason(KeyError("y")))) == "KeyError: 'y'"


def test_ingest_workers_auto_is_the_affinity_capped_by_slurm_less_one(monkeypatch) -> None:
    from rag.settings import ingest_worker_count, load_settings

    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    assert ingest_worker_count("auto") == 5  # one CPU left to the ingest process
    assert ingest_worker_count(3) == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "4")
    assert ingest_worker_count("auto") == 3
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "64")  # never more than the process may run on
    assert ingest_worker_count("auto") == 5
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")  # small: parse in process (a pool was slower there)
    assert ingest_worker_count("auto") == 1
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert ingest_worker_count("auto") == 1
    monkeypatch.setenv("RAG_INGEST_WORKERS", "1")
    assert load_settings().ingest_workers == 1
    monkeypatch.setenv("RAG_INGEST_WORKERS", "auto")
    assert load_settings().ingest_workers == "auto"
    monkeypatch.setenv("RAG_INGEST_WORKERS", "0")
    with pytest.raises(Exception, match="ingest_workers"):
        load_settings()


def test_workers_end_when_the_ingest_process_is_killed(tmp_path) -> None:
    """A `rag ingest` killed with SIGKILL cannot stop its parse workers: they must notice and exit."""
    import os
    import subprocess
    import sys
    import time

    (tmp_path / "a.md").write_text("# A\n\nsome text\n")
    script = f"""
import os, pathlib
from ingest.parse_pool import ParsePool
from ingest.sources import SourceItem, walk_sources
pool = ParsePool(2, 1 << 20)
item = next(i for i in walk_sources([pathlib.Path({str(tmp_path)!r})]) if isinstance(i, SourceItem))
pool.result(item, pool.submit(item))
print(" ".join(str(p) for p in pool._executor._processes), flush=True)
os.kill(os.getpid(), 9)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    workers = [int(p) for p in done.stdout.split()]
    assert workers  # started on demand: one for one source

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 15
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in workers), "parse workers outlived the killed ingest process"


def _parsers_already_imported() -> dict[str, bool]:
    """Run in a worker: which heavy parser modules it holds (before parsing anything of theirs)."""
    import sys

    return {name: name in sys.modules for name in ("unstructured.partition.pdf", "unstructured.partition.docx",
                                                  "ingest.parse_forkserver")}


def test_workers_start_with_the_parsers_warm(tmp_path) -> None:
    """Workers fork from a server that imported and warmed every parser once (not ~10 s each, cold)."""
    import multiprocessing

    from ingest.sources import SourceItem, walk_sources

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver on this platform: workers are spawned cold")
    (tmp_path / "a.md").write_text("# A\n\nsome text\n")
    pool = parse_pool.ParsePool(2, 1 << 20)
    try:
        item = next(i for i in walk_sources([tmp_path]) if isinstance(i, SourceItem))
        parsed = pool.result(item, pool.submit(item))  # a Markdown source: it needs no PDF or DOCX parser
        assert not isinstance(parsed, Exception)
        probes = [pool._executor.submit(_parsers_already_imported) for _ in range(4)]
        assert all(all(p.result(timeout=60).values()) for p in probes), [p.result() for p in probes]
    finally:
        pool.close()


def test_warm_parsers_parse_their_tiny_documents() -> None:
    from ingest.parse import _partition, _partitioner
    from ingest.parse_warm import tiny_pdf, warm_parsers

    assert set(warm_parsers()) == {"text", "md", "html", "pdf", "docx"}
    import io

    texts = [e.text for e in _partition(_partitioner("pdf"), "pdf", file=io.BytesIO(tiny_pdf("Hello there")),
                                        strategy="fast")]
    assert texts == ["Hello there"]
