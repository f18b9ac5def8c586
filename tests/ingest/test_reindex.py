"""A change of chunking or embedder builds a new version of the collection beside the live one.

Queries keep reading the complete old version while the new one is built, see the new one
once it is complete, and the old one is gone afterwards; a killed rebuild resumes into the
same new version; a rebuild that does not cover the whole collection does not switch.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from permissions.models import Principal
from rag.pipeline import Rag
from rag.settings import load_settings
from rag.types import Chunk, Document
from retrieval.rebuild import CollectionBuild
from retrieval.records import BuildSpec
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from retrieval.stores.embedded.rebuild import open_for_ingest

NEW = {"chunk_max_tokens": 48, "chunk_overlap_tokens": 8}
ANYONE = Principal("anyone")  # the corpus is public
RAG = [sys.executable, "-c", "from rag.cli import main; main()"]


def _rag(home: Path, embedder, **overrides) -> Rag:
    rag = Rag(load_settings(home=home, rerank=False, **overrides))
    rag.__dict__["embedder"] = embedder  # one model load for the module (Rag.embedder is a cached_property)
    return rag


def _corpus(root: Path) -> Path:
    for part in ("a", "b"):
        (root / part).mkdir(parents=True)
        (root / part / ".rag-acl.toml").write_text('allow = ["public"]\n')
        for i in range(4):
            body = " ".join(f"Sentence {j} of {part}{i}: the freezer in room {part.upper()}-{i}{j} holds plates."
                            for j in range(12))
            (root / part / f"doc{i}.md").write_text(f"# Doc {part}{i}\n\n{body}\n")
    return root


def _texts(rag: Rag) -> set[str]:
    return {r["text"] for r in rag.catalog.dump("default")}


def _collections(home: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(home / "catalog.sqlite") as db:
        return db.execute("SELECT name, generation FROM collections ORDER BY name").fetchall()


def _same_rows(got: list[dict], want: list[dict]) -> None:
    assert [{k: v for k, v in r.items() if k != "vector"} for r in got] == \
           [{k: v for k, v in r.items() if k != "vector"} for r in want]
    for g, w in zip(got, want, strict=True):
        assert np.allclose(g["vector"], w["vector"], atol=1e-5)


@pytest.mark.slow
def test_chunking_change_builds_a_new_version_and_switches_when_complete(tmp_path, embedder):
    corpus = _corpus(tmp_path / "corpus")
    home = tmp_path / "home"
    reader = _rag(home, embedder)  # a query service that stays up through the rebuild
    assert reader.ingest([corpus]).added == 8
    old_rows, old_texts = reader.catalog.dump("default"), _texts(reader)

    writer = _rag(home, embedder, **NEW)
    target = writer.collection(create=True)
    assert isinstance(target, CollectionBuild)
    assert "building version 2" in target.notice and "queries use version 1" in target.notice
    seen_mid_run = []

    def progress(stage: str, done: int, total: int) -> None:
        if stage != "embed":
            return
        # The build has documents now, but queries still see the whole old version.
        assert _collections(home) == [("default", 1), ("default@2", 2)]
        hits = reader.query("Which room holds the freezer?", ANYONE, k=5, generate=False).hits
        assert hits and {h.text for h in hits} <= old_texts
        _same_rows(reader.catalog.dump("default"), old_rows)
        seen_mid_run.append(done)

    report = writer.ingest([corpus], progress=progress)
    assert seen_mid_run and report.ok
    assert report.build is not None and report.build.switched and report.build.generation == 2
    assert report.build.old_documents_deleted == 8
    assert report.updated == 8 and report.added == 0  # every document embedded again, none lost

    # The reader switches on its next query, and the old version is gone: rows and index files.
    hits = reader.query("Which room holds the freezer?", ANYONE, k=5, generate=False).hits
    fresh = _rag(tmp_path / "fresh", embedder, **NEW)
    fresh.ingest([corpus])
    assert hits and {h.text for h in hits} <= _texts(fresh)
    assert reader.collection().info.chunking == {"max_tokens": 48, "overlap_tokens": 8, "title_context": True}
    assert _collections(home) == [("default", 2)]
    _same_rows(reader.catalog.dump("default"), fresh.catalog.dump("default"))
    with sqlite3.connect(home / "catalog.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM documents").fetchone()[0] == 8
        assert db.execute("SELECT COUNT(*) FROM chunks").fetchone()[0] == len(fresh.catalog.dump("default"))
    version = reader.catalog.version("default")
    assert sorted(p.name for p in (home / "indexes").iterdir()) == [f"default.v{version}.faiss"]

    # Same settings again: nothing to build, nothing re-embedded.
    again = writer.ingest([corpus])
    assert again.build is None and again.unchanged == 8 and again.chunks_written == 0


@pytest.mark.slow
def test_title_context_on_by_default_rebuilds_a_collection_built_without_it(tmp_path, embedder):
    corpus = _corpus(tmp_path / "corpus")
    for i in range(2):  # a section under the page's title: the context it gains is the title
        (corpus / "a" / f"doc{i}.md").write_text(f"# Doc a{i}\n\nIntro.\n\n## Storage\n\nPlates of a{i}: S-{i}.\n")
    home = tmp_path / "home"
    # Off: chunked, and recorded, as collections were before the setting existed.
    plain = _rag(home, embedder, chunk_title_context=False)
    assert plain.ingest([corpus]).added == 8
    assert plain.collection().info.chunking == {"max_tokens": 200, "overlap_tokens": 32}
    assert plain.ingest([corpus]).build is None

    titled = _rag(home, embedder)  # on: the default
    report = titled.ingest([corpus])
    assert report.ok and report.build is not None and report.build.switched and report.updated == 8
    assert titled.collection().info.chunking == {"max_tokens": 200, "overlap_tokens": 32, "title_context": True}
    texts = _texts(titled)
    assert {"Doc a0 › Storage\n\nPlates of a0: S-0.", "Doc a1 › Storage\n\nPlates of a1: S-1."} <= texts
    assert not any("›" in t for t in texts - {t for t in texts if "Storage" in t})  # pages of one section: no context
    assert titled.ingest([corpus]).build is None  # recorded: the next run has nothing to rebuild


def test_a_rebuild_of_part_of_the_collection_waits_and_applies_acl_changes_at_once(tmp_path, embedder):
    corpus = _corpus(tmp_path / "corpus")
    home = tmp_path / "home"
    reader = _rag(home, embedder)
    reader.ingest([corpus])
    old_rows = reader.catalog.dump("default")
    # Access to a/ is revoked while the collection is being rebuilt from a/ only.
    (corpus / "a" / ".rag-acl.toml").write_text('allow = ["group:alpha"]\n')
    writer = _rag(home, embedder, **NEW)
    report = writer.ingest([corpus / "a"])
    assert report.build is not None and not report.build.switched
    assert report.build.missing == 4 and report.build.missing_examples[0].startswith(str(corpus / "b"))
    assert "not complete" in report.build.summary() and "queries use version 1" in report.build.summary()
    assert _collections(home) == [("default", 1), ("default@2", 2)]
    # Queries still read version 1 (chunked at 200 tokens), but the revocation took effect there.
    rows = reader.catalog.dump("default")
    assert [r["text"] for r in rows] == [r["text"] for r in old_rows]
    hits = reader.query("freezer room", ANYONE, k=10, generate=False).hits
    assert hits and all("/b/" in h.document_key for h in hits)
    assert any("/a/" in h.document_key
               for h in reader.query("freezer room", Principal("x", frozenset({"alpha"})), k=10,
                                     generate=False).hits)

    # The other path completes version 2; a/ is not embedded again.
    report = writer.ingest([corpus / "b"])
    assert report.build is not None and report.build.switched
    assert report.updated == 4 and report.unchanged == 0
    assert _collections(home) == [("default", 2)]
    fresh = _rag(tmp_path / "fresh", embedder, **NEW)
    fresh.ingest([corpus])
    _same_rows(reader.catalog.dump("default"), fresh.catalog.dump("default"))


def test_embedder_change_switches_dimension_and_leftovers_are_dropped(tmp_path):
    """The same promotion with another embedder (8 dims instead of 16), at the store level."""
    catalog = Catalog(tmp_path / "catalog.sqlite")
    index_dir = tmp_path / "indexes"
    old = BuildSpec("model-a", "fp-a", 16, {"max_tokens": 200, "overlap_tokens": 32})
    new = BuildSpec("model-b", "fp-b", 8, {"max_tokens": 200, "overlap_tokens": 32})
    opened: dict[str, EmbeddedCollection] = {}

    def open_live() -> EmbeddedCollection:
        if "c" not in opened:
            opened["c"] = EmbeddedCollection(catalog, catalog.get_collection("c"), index_dir)
        return opened["c"]

    def write(store, spec: BuildSpec, keys: list[str]) -> None:
        for key in keys:
            doc = Document(key=key, source=key, text="t", content_hash=f"h-{key}", acl=None)
            store.replace_document(doc, frozenset({"public"}), [Chunk(key, 0, f"{key} text", 2)],
                                   np.eye(1, spec.dim, dtype=np.float32))
        store.save()

    live = open_for_ingest(catalog, "c", old, index_dir, "faiss", open_live)
    write(live, old, ["k1", "k2"])
    build = open_for_ingest(catalog, "c", new, index_dir, "faiss", open_live)
    assert isinstance(build, CollectionBuild) and build.info.dim == 8
    write(build, new, ["k1"])
    # Killed here: the next run with the same embedder resumes the same version 2.
    build = open_for_ingest(catalog, "c", new, index_dir, "faiss", open_live)
    assert isinstance(build, CollectionBuild) and set(build.build.document_states()) == {"k1"}
    write(build, new, ["k2"])
    # Pretend the run died right after the switch, before the old version was dropped.
    retired = catalog.promote("c", build.info.name)
    assert catalog.collection_names() == ["c"] and retired == "c@1"
    assert open_live().refresh() and open_live().info.dim == 8 and open_live().vectors.count() == 2
    assert open_live().search(np.eye(1, 8, dtype=np.float32)[0], 5, ["public"])
    # The next ingest drops the leftover (and its index file) before anything else.
    again = open_for_ingest(catalog, "c", new, index_dir, "faiss", open_live)
    assert again is open_live()
    assert [i.name for i in catalog.hidden_generations("c")] == []
    assert catalog.collection_stats("c") == {"documents": 2, "chunks": 2}
    # Settings going back to the old embedder start a version 3 beside the live 2.
    back = open_for_ingest(catalog, "c", old, index_dir, "faiss", open_live)
    assert isinstance(back, CollectionBuild) and back.info.name == "c@3"
    # ...and asking for version 2's settings again drops that unfinished build.
    assert open_for_ingest(catalog, "c", new, index_dir, "faiss", open_live) is open_live()
    assert catalog.hidden_generations("c") == []
    catalog.close()


@pytest.mark.slow  # three `rag ingest` processes
def test_a_killed_rebuild_resumes_into_the_same_version(tmp_path, embedder):
    corpus = _corpus(tmp_path / "corpus")
    for i in range(30):  # enough documents for the kill to land in the middle of the build
        (corpus / "b" / f"more{i}.md").write_text(f"# More {i}\n\nThe incubator {i} is set to {30 + i} degrees.\n")
    home = tmp_path / "home"
    reader = _rag(home, embedder)
    reader.ingest([corpus])
    old_rows = reader.catalog.dump("default")
    # Small embed batches: the catalog commits its documents at each batch's end, so with the
    # default (256 chunks) the whole rebuild could land in one commit and leave no moment to kill.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAG_CHUNK_MAX_TOKENS": "48", "RAG_CHUNK_OVERLAP_TOKENS": "8",
           "RAG_INGEST_BATCH_CHUNKS": "2"}
    cmd = RAG + ["--home", str(home), "ingest", str(corpus), "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    while proc.poll() is None:
        with sqlite3.connect(f"file:{home / 'catalog.sqlite'}?mode=ro", uri=True) as db:
            built = db.execute("SELECT COUNT(*) FROM documents WHERE collection = 'default@2'").fetchone()[0]
        if built >= 10:
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() - started < 300
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the rebuild finished before it could be killed"
    assert _collections(home) == [("default", 1), ("default@2", 2)]
    _same_rows(reader.catalog.dump("default"), old_rows)  # queries never saw the half-built version
    with sqlite3.connect(home / "catalog.sqlite") as db:
        built = db.execute("SELECT COUNT(*) FROM documents WHERE collection = 'default@2'").fetchone()[0]

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "building version 2" in done.stderr
    summary = json.loads(done.stdout)
    assert summary["build"]["switched"] and summary["build"]["generation"] == 2
    assert summary["unchanged"] == built and summary["updated"] == 38 - built  # nothing embedded twice
    fresh = _rag(tmp_path / "fresh", embedder, **NEW)
    fresh.ingest([corpus])
    _same_rows(reader.catalog.dump("default"), fresh.catalog.dump("default"))
    assert _collections(home) == [("default", 2)]


def test_pgvector_chunking_change_builds_a_version_beside_the_live_one(tmp_path, embedder, pg_dsn):
    """pgvector: the same contract as the embedded store, with readers in other processes' shoes."""
    from retrieval.stores.pgvector.schema import hidden_generations, list_collections

    corpus = _corpus(tmp_path / "corpus")
    reader = _rag(tmp_path / "reader", embedder, store="pgvector", dsn=pg_dsn)
    reader.ingest([corpus])
    old_texts = {r["text"] for r in reader.collection().dump()}
    # A rebuild from a/ only, while access to a/ is revoked.
    (corpus / "a" / ".rag-acl.toml").write_text('allow = ["group:alpha"]\n')
    writer = _rag(tmp_path / "writer", embedder, store="pgvector", dsn=pg_dsn, **NEW)
    report = writer.ingest([corpus / "a"])
    assert report.build is not None and not report.build.switched
    assert report.build.missing == 4 and report.build.missing_examples[0].startswith(str(corpus / "b"))
    assert [(h.name, h.generation) for h in hidden_generations(pg_dsn, "default")] == [("default@2", 2)]
    assert list(list_collections(pg_dsn)) == ["default"]  # the build is not a collection of its own
    # Queries still read version 1 (and its chunks), with the revocation applied there.
    assert {r["text"] for r in reader.collection().dump()} == old_texts
    hits = reader.query("freezer room", ANYONE, k=10, generate=False).hits
    assert hits and all("/b/" in h.document_key for h in hits)
    assert {h.text for h in hits} <= old_texts

    # Completing it switches; the reader's open collection follows on its next query.
    report = writer.ingest([corpus / "b"])
    assert report.build is not None and report.build.switched and report.build.old_documents_deleted == 8
    assert report.updated == 4 and report.unchanged == 0  # a/ was not embedded again
    assert hidden_generations(pg_dsn, "default") == []
    hits = reader.query("freezer room", ANYONE, k=10, generate=False).hits
    fresh = _rag(tmp_path / "fresh", embedder, store="pgvector", dsn=pg_dsn, **NEW)
    fresh.ingest([corpus], collection="fresh")
    new_texts = {r["text"] for r in fresh.collection("fresh").dump()}
    assert hits and {h.text for h in hits} <= new_texts and not new_texts & old_texts
    assert list_collections(pg_dsn)["default"] == list_collections(pg_dsn)["fresh"]
    # Running again with the new settings changes nothing.
    again = writer.ingest([corpus])
    assert again.build is None and again.unchanged == 8
    for rag in (reader, writer, fresh):
        rag.close()


def test_pgvector_embedder_change_resumes_switches_dimension_and_drops_leftovers(pg_dsn):
    from retrieval.stores.pgvector import rebuild as pg_rebuild
    from retrieval.stores.pgvector.collection import PgvectorCollection
    from retrieval.stores.pgvector.schema import hidden_generations

    old = BuildSpec("model-a", "fp-a", 16, {"max_tokens": 200, "overlap_tokens": 32})
    new = BuildSpec("model-b", "fp-b", 8, {"max_tokens": 200, "overlap_tokens": 32})

    def write(store, spec: BuildSpec, keys: list[str]) -> None:
        for key in keys:
            doc = Document(key=key, source=key, text="t", content_hash=f"h-{key}", acl=None)
            store.replace_document(doc, frozenset({"public"}), [Chunk(key, 0, f"{key} text", 2)],
                                   np.eye(1, spec.dim, dtype=np.float32))
        store.flush()  # an ingest's store batches its writes: commit them, as the end of a run does

    live = pg_rebuild.open_for_ingest(pg_dsn, "c", old)
    assert isinstance(live, PgvectorCollection)
    write(live, old, ["k1", "k2"])
    build = pg_rebuild.open_for_ingest(pg_dsn, "c", new)
    assert isinstance(build, pg_rebuild.PgvectorBuild) and build.info.dim == 8
    write(build, new, ["k1"])
    assert build.finish().missing == 1
    build.close()
    # Killed here: the next run with the same embedder resumes version 2.
    build = pg_rebuild.open_for_ingest(pg_dsn, "c", new)
    assert isinstance(build, pg_rebuild.PgvectorBuild) and build.info.name == "c@2"
    assert set(build.build.document_states()) == {"k1"}
    assert set(build.document_states()) == {"k1", "k2"}  # k2 still to do (its hash matches nothing)
    write(build, new, ["k2"])
    assert live.search(np.eye(1, 16, dtype=np.float32)[0], 5, ["public"])  # still version 1 meanwhile
    outcome = build.finish()
    assert outcome.switched and outcome.old_documents_deleted == 2
    build.close()
    # The collection opened before the switch follows it: 8 dims now.
    assert live.refresh() and live.info.dim == 8 and live.name == "c" and live.physical == "c@2"
    assert len(live.search(np.eye(1, 8, dtype=np.float32)[0], 5, ["public"])) == 2
    assert live.stats() == {"documents": 2, "chunks": 2}
    # Settings going back to the old embedder start version 3 beside the live 2...
    back = pg_rebuild.open_for_ingest(pg_dsn, "c", old)
    assert isinstance(back, pg_rebuild.PgvectorBuild) and back.info.name == "c@3"
    back.close()
    # ...and asking for version 2's settings again drops that unfinished build.
    again = pg_rebuild.open_for_ingest(pg_dsn, "c", new)
    assert isinstance(again, PgvectorCollection) and again.physical == "c@2"
    assert hidden_generations(pg_dsn, "c") == []
    for store in (live, again):
        store.close()


def test_pgvector_a_switch_by_one_shard_job_is_seen_by_the_others(pg_dsn):
    """Two shard jobs build the same version; the last to finish switches, the other finds it done."""
    from retrieval.stores.pgvector import rebuild as pg_rebuild

    old = BuildSpec("model-a", "fp-a", 4, {"max_tokens": 200, "overlap_tokens": 32})
    new = BuildSpec("model-a", "fp-a", 4, {"max_tokens": 100, "overlap_tokens": 16})
    live = pg_rebuild.open_for_ingest(pg_dsn, "s", old)
    for key in ("k1", "k2"):
        doc = Document(key=key, source=key, text="t", content_hash=f"h-{key}", acl=None)
        live.replace_document(doc, frozenset({"public"}), [Chunk(key, 0, "x", 1)], np.eye(1, 4, dtype=np.float32))
    live.flush()  # an ingest's store batches its writes: commit them, as the end of a run does
    jobs = [pg_rebuild.open_for_ingest(pg_dsn, "s", new) for _ in range(2)]
    assert [j.info.name for j in jobs] == ["s@2", "s@2"]
    for job, key in zip(jobs, ("k1", "k2"), strict=True):
        doc = Document(key=key, source=key, text="t", content_hash=f"h-{key}", acl=None)
        job.replace_document(doc, frozenset({"public"}), [Chunk(key, 0, "y", 1)], np.eye(1, 4, dtype=np.float32))
    for job in jobs:
        job.save()  # the end of each job's run (ingest saves before it finishes)
    first, second = jobs[1].finish(), jobs[0].finish()
    assert first.switched and first.old_documents_deleted == 2
    assert second.switched and second.old_documents_deleted == 0
    assert live.refresh() and live.stats() == {"documents": 2, "chunks": 2}
    for store in (live, *jobs):
        store.close()
