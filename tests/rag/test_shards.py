"""Sharded ingest (Slurm job arrays): N shard jobs, then a merge, give the collection of one job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from permissions.models import Principal
from rag.errors import ConfigError, NotFoundError, StoreError
from rag.shards.layout import INGESTING, find_shard_dirs, read_record, shard_dir, write_record
from rag.shards.merge import merge_shards
from rag.shards.run import ingest_shard, resolve_shard
from tests.pg_fixture import fresh_database
from tests.rag.conftest import LAB_DOCS, REPO, rag_factory  # noqa: F401 - rag_factory is a fixture

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

N = 3
QUERIES = ["Which GPU nodes can I use?", "How do I book the cryo-EM microscope?", "storage quota"]
PRINCIPALS = [Principal("dave"), Principal("bob", frozenset({"imaging"}))]
CLI = [sys.executable, "-c", "from rag.cli import main; main()"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small private corpus: the public area (every format) and the imaging group's text files."""
    root = tmp_path_factory.mktemp("shard-corpus") / "lab-docs"
    shutil.copytree(LAB_DOCS / "public", root / "public")
    shutil.copytree(LAB_DOCS / "imaging", root / "imaging", ignore=shutil.ignore_patterns("*.pdf", "*.docx", "*.html"))
    return root


@pytest.fixture(scope="module")
def single(tmp_path_factory, rag_factory, corpus):  # noqa: F811
    """One ordinary job over the corpus: what every sharded variant must equal."""
    rag = rag_factory(tmp_path_factory.mktemp("single-home"), rerank=False)
    report = rag.ingest([corpus])
    assert report.ok, report.problems
    return rag


def _rows(rag) -> list[dict]:
    return rag.collection().dump()


def assert_same_collection(got, want, queries: bool = True) -> None:
    """Same documents, hashes, ACLs, chunks and (allclose) vectors; the same hits for a few queries."""
    a, b = _rows(got), _rows(want)
    assert a, "the collection is empty"
    assert [{k: v for k, v in r.items() if k != "vector"} for r in a] == \
           [{k: v for k, v in r.items() if k != "vector"} for r in b]
    for x, y in zip(a, b, strict=True):
        assert np.allclose(x["vector"], y["vector"], atol=1e-5), x["key"]
    if not queries:
        return
    for principal in PRINCIPALS:
        for q in QUERIES:
            hits_a = got.query(q, principal, k=5, generate=False).hits
            hits_b = want.query(q, principal, k=5, generate=False).hits
            assert [(h.document_key, h.chunk_index) for h in hits_a] == \
                   [(h.document_key, h.chunk_index) for h in hits_b], (principal, q)
            assert np.allclose([h.score for h in hits_a], [h.score for h in hits_b], atol=1e-4)


def test_resolve_shard_from_options_and_slurm_variables():
    assert resolve_shard(None, None, {}) is None
    assert resolve_shard(2, 3, {}) == (2, 3)
    assert resolve_shard(0, 1, {}) is None  # one shard is the whole corpus
    array_from_0 = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "8"}
    assert resolve_shard(None, None, array_from_0) == (4, 8)
    array_from_1 = {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "8"}
    assert resolve_shard(None, None, array_from_1) == (7, 8)
    stepped = {"SLURM_ARRAY_TASK_ID": "14", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_MAX": "16",
               "SLURM_ARRAY_TASK_STEP": "2"}
    assert resolve_shard(None, None, stepped) == (2, 4)
    assert resolve_shard(1, None, array_from_0) == (1, 8)  # options win over the array's variables
    assert resolve_shard(None, 1, array_from_0) is None   # --num-shards 1 turns sharding off in an array
    with pytest.raises(ConfigError, match="shard 3 is out of range for 3 shards"):
        resolve_shard(3, 3, {})
    with pytest.raises(ConfigError, match="out of range"):
        resolve_shard(-1, 3, {})
    with pytest.raises(ConfigError, match="shard 8 is out of range"):  # --array=1-8 read as if from 0
        resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "8"})
    with pytest.raises(ConfigError, match="--shard needs --num-shards"):
        resolve_shard(1, None, {})
    with pytest.raises(ConfigError, match="--num-shards needs --shard"):
        resolve_shard(None, 4, {})
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_ID"):
        resolve_shard(None, None, {"SLURM_ARRAY_TASK_ID": "x"})


def test_shards_then_merge_equal_one_job(tmp_path, rag_factory, corpus, single):  # noqa: F811
    rag = rag_factory(tmp_path / "home", rerank=False)
    runs = [ingest_shard(rag, [corpus], None, i, N) for i in range(N)]
    num_docs = single.collection().stats()["documents"]
    assert all(r.report.ok for r in runs)
    assert sum(r.report.added for r in runs) == num_docs
    # (Which shard gets which document depends on the absolute paths, i.e. on the temporary
    # directory: a shard may by chance get none, which the merge must handle too.)
    assert rag.catalog.find_collection("default") is None  # shards never write the main catalog

    # A missing shard, then one whose job did not finish: refused, naming them.
    moved = tmp_path / "elsewhere"
    shutil.move(shard_dir(rag.settings.home, "default", 2, N), moved)
    with pytest.raises(NotFoundError, match="shard 2 missing"):
        merge_shards(rag)
    shutil.move(moved, shard_dir(rag.settings.home, "default", 2, N))
    one = shard_dir(rag.settings.home, "default", 1, N)
    record = read_record(one)
    record.state = INGESTING
    write_record(one, record)
    with pytest.raises(NotFoundError, match="shard 1 did not finish"):
        merge_shards(rag)
    assert rag.catalog.find_collection("default") is None
    record = read_record(one)
    record.state = "complete"
    write_record(one, record)

    report = merge_shards(rag, keep_shards=True)
    assert report.counts.added == num_docs and report.counts.chunks_written == single.collection().stats()["chunks"]
    assert_same_collection(rag, single)

    # Merging again changes nothing: with the shards still there, after a merge that was stopped
    # while removing them (it finishes the cleanup), and once they are gone.
    version = rag.catalog.version("default")
    again = merge_shards(rag, keep_shards=True)
    assert again.counts.changes == 0 and again.counts.unchanged == num_docs
    shutil.rmtree(shard_dir(rag.settings.home, "default", 0, N))
    cleanup = merge_shards(rag)
    assert cleanup.already_merged and cleanup.shards_removed
    assert find_shard_dirs(rag.settings.home, "default") == {}
    assert merge_shards(rag).already_merged
    assert rag.catalog.version("default") == version
    assert_same_collection(rag, single, queries=False)


def test_concurrent_shard_jobs_from_the_cli(tmp_path, rag_factory, corpus, single):  # noqa: F811
    home = tmp_path / "home"
    rag_factory(home).close()  # the data directory with its model cache, as a user would have it
    jobs = []
    for i in range(N):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_ARRAY_")}
        if i == 2:  # task 3 of an array --array=1-3: the shard comes from Slurm's variables
            args = []
            env |= {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "3"}
        else:
            args = ["--shard", str(i), "--num-shards", str(N)]
        jobs.append(subprocess.Popen(
            [*CLI, "--home", str(home), "ingest", str(corpus), *args, "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO))
    outs = [job.communicate(timeout=600) for job in jobs]
    for job, (_, err) in zip(jobs, outs, strict=True):
        assert job.returncode == 0, err
    bodies = [json.loads(out) for out, _ in outs]
    assert [(b["shard"], b["num_shards"]) for b in bodies] == [(i, N) for i in range(N)]
    assert all(b["shard_dir"].endswith(f"{b['shard']}-of-{N}") for b in bodies)

    merged = subprocess.run([*CLI, "--home", str(home), "index", "merge", "--json"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert merged.returncode == 0, merged.stderr
    body = json.loads(merged.stdout)
    num_docs = single.collection().stats()["documents"]
    assert body["added"] == num_docs and body["shards_removed"]
    assert body["collection_stats"] == single.collection().stats()
    assert_same_collection(rag_factory(home, rerank=False), single)


def test_rerun_after_edits_then_merge_equals_a_fresh_job(tmp_path, rag_factory):  # noqa: F811
    docs = tmp_path / "docs"
    shutil.copytree(LAB_DOCS / "public", docs / "public", ignore=shutil.ignore_patterns("*.pdf", "*.docx"))
    # Which shard a document lands in hashes its absolute path, so with this tiny corpus one
    # shard may hold both deletions of the rerun and (rightly) refuse them as more than half of
    # its documents: the guard is tested elsewhere, this test is about the merge.
    rag = rag_factory(tmp_path / "home", rerank=False, max_delete_fraction=1.0)
    for i in range(N):
        assert ingest_shard(rag, [docs], None, i, N).report.ok
    first = merge_shards(rag)
    assert first.shards_removed and first.counts.added > 0

    public = docs / "public"
    guide = public / "cluster-user-guide.md"
    guide.write_text(guide.read_text() + "\n## Reservations\n\nAsk the helpdesk for node reservations.\n")
    (public / "seminar-schedule.md").unlink()
    (public / "new-note.md").write_text("# Scratch purge\n\nScratch files older than 30 days are purged.\n")
    sidecar = public / ".rag-acl.toml"
    sidecar.write_text(sidecar.read_text() + '\n[[rule]]\nmatch = "storage-quotas.txt"\nallow = ["group:hpc-admins"]\n')
    faq = public / "helpdesk-faq.jsonl"
    faq.write_text("".join(faq.read_text().splitlines(keepends=True)[1:]))  # one record gone

    # The shard directories were removed by the merge: new shards start from the collection,
    # so only the edited and new documents are embedded again.
    runs = [ingest_shard(rag, [docs], None, i, N) for i in range(N)]
    assert all(r.report.ok for r in runs)
    assert sum(r.seeded.added for r in runs) == first.counts.added
    total = {k: sum(getattr(r.report, k) for r in runs) for k in ("added", "updated", "deleted", "acl_updated")}
    assert total == {"added": 1, "updated": 1, "deleted": 2, "acl_updated": 1}
    report = merge_shards(rag)
    c = report.counts
    assert (c.added, c.updated, c.deleted, c.acl_updated) == (1, 1, 2, 1)

    fresh = rag_factory(tmp_path / "fresh", rerank=False)
    assert fresh.ingest([docs]).ok
    assert_same_collection(rag, fresh)
    dave = [h.document_key for q in QUERIES for h in rag.query(q, Principal("dave"), generate=False).hits]
    assert str(public / "storage-quotas.txt") not in dave  # the new ACL took effect


def test_merge_checks_the_shards_and_builds_a_new_version_for_new_settings(tmp_path, rag_factory):  # noqa: F811
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    for n in range(4):  # about 150 tokens each: one chunk of at most 200 tokens, several of 100
        text = " ".join(f"Node n{n}-{i} is reserved for group g{i} on weekdays." for i in range(12))
        (tree / ("sub" if n % 2 else ".") / f"note{n}.md").write_text(f"# Note {n}\n\n{text}\n")
    rag = rag_factory(tmp_path / "home", rerank=False)
    small = rag_factory(tmp_path / "home", rerank=False, chunk_max_tokens=100)
    ingest_shard(rag, [tree], None, 0, 2)
    ingest_shard(rag, [tree / "sub"], None, 1, 2)
    with pytest.raises(ConfigError, match="different paths"):
        merge_shards(rag)
    ingest_shard(small, [tree], None, 1, 2)
    with pytest.raises(StoreError, match="built differently"):
        merge_shards(rag)
    ingest_shard(rag, [tree], None, 1, 2)
    assert merge_shards(rag).counts.added == 4
    assert len(rag.collection().dump()) == 4  # one chunk per note
    with pytest.raises(NotFoundError, match="no shards of collection 'elsewhere'"):
        merge_shards(rag, "elsewhere")

    # The array again with smaller chunks: nothing to reuse, and the merge builds the collection's
    # next version and switches to it, as one job with these settings would.
    runs = [ingest_shard(small, [tree], None, i, 2) for i in range(2)]
    assert all(r.seeded is None for r in runs)
    report = merge_shards(small)
    assert report.build is not None and report.build.switched
    one = rag_factory(tmp_path / "one", rerank=False, chunk_max_tokens=100)
    assert one.ingest([tree]).ok
    reader = rag_factory(tmp_path / "home", rerank=False)
    assert_same_collection(reader, one, queries=False)
    assert len(reader.collection().dump()) > 4
    assert reader.collection().info.chunking["max_tokens"] == 100


def test_pgvector_shards_write_the_collection_like_one_job(tmp_path, rag_factory, corpus, pg_server):  # noqa: F811
    with fresh_database(pg_server) as sharded_dsn, fresh_database(pg_server) as single_dsn:
        sharded = rag_factory(tmp_path / "sharded", store="pgvector", dsn=sharded_dsn, rerank=False)
        runs = [ingest_shard(sharded, [corpus], None, i, N) for i in range(N)]
        assert all(r.report.ok and r.directory is None for r in runs)
        assert not (tmp_path / "sharded" / "shards").exists()
        one = rag_factory(tmp_path / "single", store="pgvector", dsn=single_dsn, rerank=False)
        assert one.ingest([corpus]).ok
        assert_same_collection(sharded, one, queries=False)
        with pytest.raises(ConfigError, match="nothing to merge"):
            merge_shards(sharded)
        sharded.close()
        one.close()
