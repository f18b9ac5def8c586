"""An empty or unmounted root never wipes a collection, nor does one run delete most of it (issue 13, item 7).

Through the real `rag ingest` (a subprocess) and the Python API, on the embedded store and
pgvector, unsharded and as Slurm-style shards: a root that yields nothing while the collection
holds documents from it is an error that changes nothing; deleting more than
max_delete_fraction is refused (nothing deleted) unless --allow-mass-delete; and a shard never
deletes records that another shard's part of the walk could not read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ingest.deletion_guard import DeletionGuard, MassDeleteError
from ingest.pipeline import shard_of
from rag.errors import NotFoundError
from rag.shards.merge import merge_shards
from rag.shards.run import ingest_shard
from tests.rag.conftest import rag_factory  # noqa: F401 - a fixture

RAG = [sys.executable, "-c", "from rag.cli import main; main()"]


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    return subprocess.run(RAG + args, env=env, capture_output=True, text=True, timeout=600)


def _corpus(root: Path, n: int) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    (root / ".rag-acl.toml").write_text('allow = ["group:lab"]\n')
    files = []
    for i in range(n):
        f = root / f"note{i}.md"
        f.write_text(f"# Note {i}\n\nFreezer {i} holds rack {i * 7} of the lab's samples.\n")
        files.append(f)
    return files


@pytest.fixture
def home(tmp_path, model_cache) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(model_cache, target_is_directory=True)
    return home


def _documents(home: Path) -> int:
    r = _cli(["collections"], home)
    assert r.returncode == 0, r.stderr
    return sum(int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("default:"))


@pytest.mark.slow
def test_cli_refuses_an_empty_root_and_deletes_nothing(tmp_path, home) -> None:
    mount = tmp_path / "mnt" / "lab"
    _corpus(mount, 3)
    first = _cli(["ingest", str(mount), "--json"], home)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["added"] == 3

    # The file system is unmounted: the mount point is an empty directory.
    for f in list(mount.iterdir()):
        f.rename(tmp_path / f.name)
    r = _cli(["ingest", str(mount), "--json"], home)
    assert r.returncode == 2 and r.stdout == ""
    assert f"{mount} has no documents to ingest, but the collection holds 3 from it" in r.stderr
    assert "--allow-mass-delete" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # A moved (missing) root is refused before anything is read, too.
    gone = _cli(["ingest", str(tmp_path / "moved"), "--json"], home)
    assert gone.returncode == 2 and "path not found" in gone.stderr
    assert _documents(home) == 3

    meant = _cli(["ingest", str(mount), "--json", "--allow-mass-delete"], home)
    assert meant.returncode == 0, meant.stderr
    assert json.loads(meant.stdout)["deleted"] == 3


@pytest.mark.slow
def test_cli_refuses_to_delete_more_than_the_fraction(tmp_path, home) -> None:
    files = _corpus(tmp_path / "lab", 4)
    assert _cli(["ingest", str(tmp_path / "lab")], home).returncode == 0
    for f in files[1:]:
        f.unlink()
    r = _cli(["ingest", str(tmp_path / "lab"), "--json"], home)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["deleted"] == 0 and not out["ok"]
    assert {k: out["deletion_refused"][k] for k in ("would_delete", "documents", "max_fraction")} == {
        "would_delete": 3, "documents": 4, "max_fraction": 0.5}
    assert _documents(home) == 4
    text = _cli(["ingest", str(tmp_path / "lab")], home)
    assert text.returncode == 1
    assert "error: refused to delete 3 of 4 documents (more than 50%; nothing was deleted)" in text.stdout

    ok = _cli(["ingest", str(tmp_path / "lab"), "--json", "--max-delete-fraction", "0.8"], home)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["deleted"] == 3 and _documents(home) == 1


def test_cli_help_explains_the_flags(home) -> None:
    r = _cli(["ingest", "--help"], home)
    assert r.returncode == 0
    assert "--allow-mass-delete" in r.stdout and "--max-delete-fraction" in r.stdout
    bad = _cli(["ingest", "--max-delete-fraction", "2", "."], home)
    assert bad.returncode == 2 and "max-delete-fraction" in bad.stderr


@pytest.fixture(params=["faiss", "pgvector"])
def store(request) -> dict:
    if request.param == "faiss":
        return {}
    return {"store": "pgvector", "dsn": request.getfixturevalue("pg_dsn")}


def test_api_guard_on_both_stores(tmp_path, rag_factory, store) -> None:  # noqa: F811
    rag = rag_factory(tmp_path / "home", rerank=False, **store)
    files = _corpus(tmp_path / "lab", 4)
    other = _corpus(tmp_path / "other", 2)
    assert rag.ingest([tmp_path / "lab"]).ok and rag.ingest([tmp_path / "other"]).ok
    for f in files:
        f.unlink()
    with pytest.raises(MassDeleteError, match="holds 4 from it"):
        rag.ingest([tmp_path / "lab"])
    assert rag.collection().stats()["documents"] == 6
    # Two of the six documents gone is within the default half.
    other[0].unlink()
    other[1].unlink()
    (tmp_path / "other" / "new.md").write_text("# New\n\nThe -80 freezer alarm number is 4411.\n")
    report = rag.ingest([tmp_path / "other"])
    assert report.ok and report.deleted == 2 and report.added == 1
    report = rag.ingest([tmp_path / "lab"], allow_mass_delete=True)
    assert report.ok and report.deleted == 4
    assert rag.collection().stats()["documents"] == 1
    rag.close()


def test_setting_sets_the_fraction(tmp_path, rag_factory) -> None:  # noqa: F811
    rag = rag_factory(tmp_path / "home", rerank=False, max_delete_fraction=0.0)
    files = _corpus(tmp_path / "lab", 3)
    rag.ingest([tmp_path / "lab"])
    files[0].unlink()
    report = rag.ingest([tmp_path / "lab"])
    assert report.deletion_refused is not None and report.deleted == 0 and not report.ok
    assert rag.collection().stats()["documents"] == 3


def test_guard_rejects_a_fraction_outside_0_to_1() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        DeletionGuard(1.5)


def test_pgvector_shards_refuse_an_empty_root(tmp_path, rag_factory, pg_dsn) -> None:  # noqa: F811
    rag = rag_factory(tmp_path / "home", rerank=False, store="pgvector", dsn=pg_dsn)
    files = _corpus(tmp_path / "lab", 6)
    assert rag.ingest([tmp_path / "lab"]).ok
    for f in files:
        f.unlink()
    for shard in range(3):
        with pytest.raises(MassDeleteError):
            ingest_shard(rag, [tmp_path / "lab"], None, shard, 3)
    assert rag.collection().stats()["documents"] == 6
    rag.close()


def test_embedded_shard_with_an_empty_root_never_merges(tmp_path, rag_factory) -> None:  # noqa: F811
    rag = rag_factory(tmp_path / "home", rerank=False)
    files = _corpus(tmp_path / "lab", 6)
    assert rag.ingest([tmp_path / "lab"]).ok
    for f in files:
        f.unlink()
    for shard in range(2):
        with pytest.raises(MassDeleteError):
            ingest_shard(rag, [tmp_path / "lab"], None, shard, 2)
    # Refused before a shard directory was written: there is nothing to merge.
    with pytest.raises(NotFoundError, match="no shards"):
        merge_shards(rag)
    assert rag.collection().stats()["documents"] == 6


def test_an_embedded_shard_that_holds_none_of_a_root_still_refuses_it(tmp_path, rag_factory) -> None:  # noqa: F811
    """The shard's own store may hold nothing from the root (every document hashed elsewhere):
    the empty-root check is of the whole collection, so that shard refuses too (CI once drew
    such a layout of the random temp path and the shard ran "successfully" over an empty root)."""
    rag = rag_factory(tmp_path / "home", rerank=False)
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / ".rag-acl.toml").write_text('allow = ["group:lab"]\n')
    files, i = [], 0
    while len(files) < 3:  # documents that all hash to shard 1 of 2
        f = lab / f"note{i}.md"
        if shard_of(str(f.resolve()), 2) == 1:
            f.write_text(f"# Note {i}\n\nFreezer {i} holds rack {i * 7}.\n")
            files.append(f)
        i += 1
    assert rag.ingest([lab]).ok
    assert set(rag.collection().document_states()) == {str(f.resolve()) for f in files}
    for f in files:
        f.unlink()
    with pytest.raises(MassDeleteError):
        ingest_shard(rag, [lab], None, 0, 2)
    assert rag.collection().stats()["documents"] == 3
    rag.close()


def _notes_with_a_line_that_another_shard_reads(path: Path, n: int, num_shards: int) -> tuple[str, list[dict]]:
    """Records r0..r{n-1}, and the id of one whose line number hashes to another shard than its key."""
    records = [{"id": f"r{i}", "text": f"Shelf {i} of the cold room holds kit K-{i * 13}."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    real = str(path.resolve())
    for i in range(n):
        if shard_of(f"{real}:{i + 1}", num_shards) != shard_of(f"{real}#r{i}", num_shards):
            return f"r{i}", records
    raise AssertionError("no such record: use more records")


def _break_line(path: Path, records: list[dict], rid: str) -> None:
    lines = [json.dumps(r) if r["id"] != rid else json.dumps(r)[:-5] for r in records]
    path.write_text("\n".join(lines) + "\n")


def test_pgvector_shards_keep_records_another_shard_could_not_read(tmp_path, rag_factory, pg_dsn) -> None:  # noqa: F811
    rag = rag_factory(tmp_path / "home", rerank=False, store="pgvector", dsn=pg_dsn)
    tree = tmp_path / "lab"
    tree.mkdir()
    (tree / ".rag-acl.toml").write_text('allow = ["group:lab"]\n')
    notes = tree / "notes.jsonl"
    rid, records = _notes_with_a_line_that_another_shard_reads(notes, 12, 3)
    assert rag.ingest([tree]).ok
    _break_line(notes, records, rid)
    reports = [rag.ingest([tree], shard=(i, 3)) for i in range(3)]
    assert sum(r.deleted for r in reports) == 0
    key = f"{notes.resolve()}#{rid}"
    assert [a.source for r in reports for a in r.acl_errors] == [key]
    states = rag.collection().document_states()
    assert len(states) == 12 and states[key].acl == frozenset()  # kept, readable by nobody
    rag.close()


def test_embedded_shards_and_merge_keep_records_another_shard_could_not_read(
        tmp_path, rag_factory) -> None:  # noqa: F811
    rag = rag_factory(tmp_path / "home", rerank=False)
    tree = tmp_path / "lab"
    tree.mkdir()
    (tree / ".rag-acl.toml").write_text('allow = ["group:lab"]\n')
    notes = tree / "notes.jsonl"
    rid, records = _notes_with_a_line_that_another_shard_reads(notes, 12, 3)
    assert rag.ingest([tree]).ok
    _break_line(notes, records, rid)
    runs = [ingest_shard(rag, [tree], None, i, 3) for i in range(3)]
    assert sum(r.report.deleted for r in runs) == 0
    merged = merge_shards(rag)
    assert merged.counts.deleted == 0
    states = rag.collection().document_states()
    key = f"{notes.resolve()}#{rid}"
    assert len(states) == 12 and states[key].acl == frozenset()


def test_a_shard_measures_the_fraction_against_its_share_of_the_collection(tmp_path, rag_factory) -> None:  # noqa: F811
    """2 deletions in a shard that holds 3 of 15 documents are 2 of its fair share of 5: allowed (was refused)."""
    root = tmp_path / "lab"
    root.mkdir()
    (root / ".rag-acl.toml").write_text('allow = ["group:lab"]\n')
    num_shards, here, elsewhere, i = 3, [], [], 0
    while len(here) < 3 or len(elsewhere) < 12:  # names chosen so shard 0 holds exactly 3 of 15
        f = root / f"note{i}.md"
        i += 1
        group = here if shard_of(str(f.resolve()), num_shards) == 0 else elsewhere
        if len(group) < (3 if group is here else 12):
            f.write_text(f"# Note {i}\n\nFreezer {i} holds rack {i * 7} of the lab's samples.\n")
            group.append(f)
    rag = rag_factory(tmp_path / "home", rerank=False)
    assert rag.ingest([root]).ok
    for f in here[:2]:
        f.unlink()
    run = ingest_shard(rag, [root], None, 0, num_shards)
    assert run.report.ok and run.report.deleted == 2 and run.report.deletion_refused is None
    rag.close()
