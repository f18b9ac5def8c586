"""A document whose ACL cannot be determined is readable by nobody until it is fixed (issue 13, item 6).

Through the Python API on the embedded store and on pgvector: a broken sidecar (typo'd key, bad
TOML, empty file), a bad JSONL `acl`, an owner with no name, a source that stops parsing, a JSONL
line that cannot be read and a directory that cannot be listed never leave an older, wider ACL
live; fixing the cause and ingesting again gives the readers the fixed ACL names, and every
change that lets more principals in is reported as widened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from permissions.models import Principal
from tests.rag.conftest import rag_factory  # noqa: F401 - a fixture

ALICE = Principal("alice", frozenset({"genomics"}))
IVAN = Principal("ivan", frozenset({"imaging"}))
ROOT_USER = Principal("root")  # owns the test files: POSIX gives it "user:root"
EVERYONE = {"alice": ALICE, "ivan": IVAN, "root": ROOT_USER, "nobody": Principal("nobody")}
IS_ROOT = os.geteuid() == 0


def _reads_as(rag, key: str, question: str, user: str) -> set[str]:
    hits = rag.query(question, Principal(user), k=20, generate=False).hits
    return {user} if any(h.document_key == key for h in hits) else set()


def readers(rag, key: str, question: str) -> set[str]:
    """Who of EVERYONE gets a chunk of document `key` for `question` (the store's ACL filter decides)."""
    out = set()
    for name, principal in EVERYONE.items():
        hits = rag.query(question, principal, k=20, generate=False).hits
        if any(h.document_key == key for h in hits):
            out.add(name)
    return out


@pytest.fixture(params=["faiss", "pgvector"])
def rag(request, tmp_path, rag_factory):  # noqa: F811
    """A fresh data directory on the embedded store, or on a fresh pgvector database."""
    overrides = {"rerank": False}
    if request.param == "pgvector":
        overrides |= {"store": "pgvector", "dsn": request.getfixturevalue("pg_dsn")}
    r = rag_factory(tmp_path / "home", **overrides)
    yield r
    r.close()


@pytest.fixture
def faiss_rag(tmp_path, rag_factory):  # noqa: F811
    r = rag_factory(tmp_path / "home", rerank=False)
    yield r
    r.close()


def lab_tree(root: Path) -> Path:
    """root/lab/plan.md under a sidecar that lets genomics and imaging read."""
    (root / "lab").mkdir(parents=True)
    (root / ".rag-acl.toml").write_text("allow = []\n")
    (root / "lab" / ".rag-acl.toml").write_text('allow = ["group:genomics", "group:imaging"]\n')
    plan = root / "lab" / "plan.md"
    plan.write_text("# Plan\n\nThe zebrafish incubator Z-42 is on the third floor.\n")
    plan.chmod(0o644)
    return plan


@pytest.mark.parametrize("broken", [
    'alow = ["group:genomics"]\n',  # a typo'd key
    'allow = ["group:genomics"\n',  # a syntax error
    "",  # truncated
])
def test_broken_tightened_sidecar_hides_the_document_until_fixed(rag, tmp_path, broken) -> None:
    plan = lab_tree(tmp_path / "tree")
    key, q = str(plan), "Where is the zebrafish incubator?"
    assert rag.ingest([tmp_path / "tree"]).ok
    assert readers(rag, key, q) == {"alice", "ivan"}

    # Tightening to genomics only, with a mistake: the old, wider ACL must not stay live.
    (plan.parent / ".rag-acl.toml").write_text(broken)
    report = rag.ingest([tmp_path / "tree"])
    assert readers(rag, key, q) == set()
    assert not report.ok
    assert [a.source for a in report.acl_errors] == [key]
    assert ".rag-acl.toml" in report.acl_errors[0].error
    assert report.chunks_written == 0 and report.acl_updated == 1  # stored, not re-embedded
    assert report.as_dict()["acl_errors"] == [{"source": key, "error": report.acl_errors[0].error}]

    (plan.parent / ".rag-acl.toml").write_text('allow = ["group:genomics"]\n')
    fixed = rag.ingest([tmp_path / "tree"])
    assert fixed.ok and not fixed.acl_errors
    assert readers(rag, key, q) == {"alice"}
    # From nobody to genomics: more principals than before, so it is reported.
    assert fixed.as_dict()["widened"] == [{"source": key, "before": [], "after": ["group:genomics"]}]


def test_new_document_under_a_broken_sidecar_is_stored_for_nobody(rag, tmp_path) -> None:
    tree = tmp_path / "tree"
    plan = lab_tree(tree)
    (plan.parent / ".rag-acl.toml").write_text('allow = ["group:genomics" "user:x"]\n')
    report = rag.ingest([tree])
    assert [a.source for a in report.acl_errors] == [str(plan)] and report.added == 1
    assert readers(rag, str(plan), "Where is the zebrafish incubator?") == set()
    (plan.parent / ".rag-acl.toml").write_text('allow = ["group:imaging"]\n')
    again = rag.ingest([tree])
    assert again.ok and again.chunks_written == 0  # the fix is an ACL-only update
    assert readers(rag, str(plan), "Where is the zebrafish incubator?") == {"ivan"}


def test_deleted_sidecar_is_reported_as_widening(rag, tmp_path) -> None:
    plan = lab_tree(tmp_path / "tree")
    (tmp_path / "tree" / ".rag-acl.toml").unlink()
    assert rag.ingest([tmp_path / "tree"]).ok
    (plan.parent / ".rag-acl.toml").unlink()  # POSIX now decides: 0644 is everyone
    report = rag.ingest([tmp_path / "tree"])
    assert report.ok  # a widening is reported, not refused
    (w,) = report.widened
    assert w.source == str(plan) and w.before == frozenset({"group:genomics", "group:imaging"})
    assert "public" in w.after
    assert readers(rag, str(plan), "Where is the zebrafish incubator?") == set(EVERYONE)


def test_narrowing_is_not_reported_as_widening(faiss_rag, tmp_path) -> None:
    plan = lab_tree(tmp_path / "tree")
    faiss_rag.ingest([tmp_path / "tree"])
    (plan.parent / ".rag-acl.toml").write_text('allow = ["group:genomics"]\n')
    report = faiss_rag.ingest([tmp_path / "tree"])
    assert report.ok and report.acl_updated == 1 and report.widened == []


def test_bad_explicit_acl_in_jsonl_never_falls_back_to_the_file_acl(rag, tmp_path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / ".rag-acl.toml").write_text('allow = ["public"]\n')  # the file's ACL: everyone
    notes = tree / "notes.jsonl"
    good = {"id": "r1", "text": "The cryostat service code is C-7781.", "acl": ["group:genomics"]}
    other = {"id": "r2", "text": "The seminar room projector needs an HDMI adapter."}
    notes.write_text(json.dumps(good) + "\n" + json.dumps(other) + "\n")
    key, q = f"{notes}#r1", "What is the cryostat service code?"
    assert rag.ingest([tree]).ok
    assert readers(rag, key, q) == {"alice"}

    for bad_acl in (["genomics"], "group:genomics", None):  # not an entry, not a list, null
        notes.write_text(json.dumps(good | {"acl": bad_acl}) + "\n" + json.dumps(other) + "\n")
        report = rag.ingest([tree])
        assert readers(rag, key, q) == set(), bad_acl  # not the file's "public"
        assert [a.source for a in report.acl_errors] == [key], bad_acl
        assert "bad 'acl'" in report.acl_errors[0].error and not report.ok

    notes.write_text(json.dumps(good | {"acl": ["group:imaging"]}) + "\n" + json.dumps(other) + "\n")
    fixed = rag.ingest([tree])
    assert fixed.ok and readers(rag, key, q) == {"ivan"}


def test_unreadable_jsonl_line_holds_the_records_it_may_be(rag, tmp_path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / ".rag-acl.toml").write_text('allow = ["group:genomics", "group:imaging"]\n')
    notes = tree / "notes.jsonl"
    records = [{"id": "r1", "text": "Liquid nitrogen is delivered on Tuesdays."},
               {"id": "r2", "text": "The sequencer login is kept by the genomics lead.",
                "acl": ["group:genomics", "group:imaging"]}]
    notes.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert rag.ingest([tree]).ok
    key, q = f"{notes}#r2", "Who keeps the sequencer login?"
    assert readers(rag, key, q) == {"alice", "ivan"}

    # r2 is narrowed with a typo that breaks the line: which record the line was is unknown.
    notes.write_text(json.dumps(records[0]) + "\n"
                     + '{"id": "r2", "text": "The sequencer login is kept by the genomics lead.", '
                       '"acl": ["group:genomics"]\n')
    report = rag.ingest([tree])
    assert readers(rag, key, q) == set()
    assert report.deleted == 0 and not report.ok
    assert [a.source for a in report.acl_errors] == [key]
    assert readers(rag, f"{notes}#r1", "When is liquid nitrogen delivered?") == {"alice", "ivan"}

    notes.write_text(json.dumps(records[0]) + "\n" + json.dumps(records[1] | {"acl": ["group:genomics"]}) + "\n")
    assert rag.ingest([tree]).ok
    assert readers(rag, key, q) == {"alice"}


def test_source_that_stops_parsing_takes_its_narrowed_acl(rag, tmp_path) -> None:
    tree = tmp_path / "tree"
    plan = lab_tree(tree)
    notes = plan.parent / "notes.txt"
    notes.write_text("The glovebox oxygen sensor reads below 1 ppm.\n")
    assert rag.ingest([tree]).ok
    q = "What does the glovebox oxygen sensor read?"
    assert readers(rag, str(notes), q) == {"alice", "ivan"}
    # The file turns binary (a bad sync) and imaging loses access in the same change: the
    # stored version stays searchable, but only for whom the sidecar names now.
    notes.write_bytes(bytes(range(256)) * 8)
    (plan.parent / ".rag-acl.toml").write_text('allow = ["group:genomics"]\n')
    report = rag.ingest([tree])
    assert [p.key for p in report.problems] == [str(notes)]
    assert readers(rag, str(notes), q) == {"alice"}


@pytest.mark.skipif(not IS_ROOT, reason="chown to a uid with no name needs root")
def test_owner_with_no_name_is_readable_by_nobody(faiss_rag, tmp_path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir(mode=0o755)
    tree.chmod(0o755)
    doc = tree / "restored.md"
    doc.write_text("# Restored\n\nThe tape archive from 2019 holds the old confocal images.\n")
    doc.chmod(0o640)
    os.chown(doc, 54321, 0)  # from another system: no passwd entry here
    report = faiss_rag.ingest([tree])
    q = "Where are the old confocal images?"
    # Not "user:54321": that could be a registered user's name.
    assert readers(faiss_rag, str(doc), q) | _reads_as(faiss_rag, str(doc), q, "54321") == set()
    assert [a.source for a in report.acl_errors] == [str(doc)]
    assert "owner uid 54321" in report.acl_errors[0].error
    os.chown(doc, 0, 0)
    assert faiss_rag.ingest([tree]).ok
    assert readers(faiss_rag, str(doc), q) == {"root"}


def test_directory_that_cannot_be_listed_keeps_its_documents_for_nobody(
        faiss_rag, tmp_path, monkeypatch) -> None:
    tree = tmp_path / "tree"
    plan = lab_tree(tree)
    assert faiss_rag.ingest([tree]).ok
    q = "Where is the zebrafish incubator?"
    # Root lists any directory, so EACCES (or a stale NFS handle) is injected where the walk lists.
    import ingest.sources

    real_scandir = os.scandir

    def scandir(path):
        if Path(path) == plan.parent:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(ingest.sources.os, "scandir", scandir)
    report = faiss_rag.ingest([tree])
    assert report.deleted == 0 and [a.source for a in report.acl_errors] == [str(plan)]
    assert "cannot list directory" in report.acl_errors[0].error
    assert readers(faiss_rag, str(plan), q) == set()
    monkeypatch.undo()
    assert faiss_rag.ingest([tree]).ok
    assert readers(faiss_rag, str(plan), q) == {"alice", "ivan"}


def test_duplicate_jsonl_id_is_readable_by_nobody(faiss_rag, tmp_path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / ".rag-acl.toml").write_text('allow = ["public"]\n')
    notes = tree / "notes.jsonl"
    wide = {"id": "r1", "text": "The mass spectrometer queue is booked through Sam.",
            "acl": ["group:genomics", "group:imaging"]}
    notes.write_text(json.dumps(wide) + "\n")
    assert faiss_rag.ingest([tree]).ok
    key, q = f"{notes}#r1", "Who books the mass spectrometer queue?"
    assert readers(faiss_rag, key, q) == {"alice", "ivan"}
    # A narrowing appended instead of edited: which of the two lines is meant is unknown.
    notes.write_text(json.dumps(wide) + "\n" + json.dumps(wide | {"acl": ["group:genomics"]}) + "\n")
    report = faiss_rag.ingest([tree])
    assert readers(faiss_rag, key, q) == set()
    assert [a.source for a in report.acl_errors] == [key] and "duplicate id 'r1'" in report.acl_errors[0].error
    notes.write_text(json.dumps(wide | {"acl": ["group:genomics"]}) + "\n")
    assert faiss_rag.ingest([tree]).ok
    assert readers(faiss_rag, key, q) == {"alice"}
