"""Re-ingest after edits, deletions and permission changes equals a fresh ingest."""

from __future__ import annotations

import json

import numpy as np

from permissions.models import Principal


def _write_tree(root):
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / ".rag-acl.toml").write_text("allow = []\n")
    (root / "a" / ".rag-acl.toml").write_text('allow = ["group:alpha"]\n')
    (root / "b" / ".rag-acl.toml").write_text('allow = ["group:beta"]\n')
    (root / "a" / "one.md").write_text("# One\n\nThe alpha centrifuge is in room A-101.\n")
    (root / "a" / "two.txt").write_text("Alpha keeps its buffers in fridge F-7.\n")
    (root / "b" / "three.md").write_text("# Three\n\nBeta books the microscope on Mondays.\n")
    (root / "b" / "four.md").write_text("# Four\n\nBeta's backup runs at 02:00 nightly.\n")
    records = [
        {"id": "r1", "text": "Record one: the shared printer is on floor 2."},
        {"id": "r2", "text": "Record two: alpha and beta share the cold room.",
         "acl": ["group:alpha", "group:beta"]},
        {"id": "r3", "text": "Record three: the old wiki is read-only."},
    ]
    (root / "b" / "notes.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def _edit_tree(root):
    (root / "a" / "one.md").write_text("# One\n\nThe alpha centrifuge moved to room A-204.\n")
    (root / "a" / "two.txt").unlink()
    (root / "b" / ".rag-acl.toml").write_text('allow = ["group:beta", "user:carl"]\n')
    (root / "a" / "five.md").write_text("# Five\n\nAlpha orders reagents on Thursdays.\n")
    records = [
        {"id": "r1", "text": "Record one: the shared printer moved to floor 3."},
        {"id": "r2", "text": "Record two: alpha and beta share the cold room.",
         "acl": ["group:alpha", "group:beta"]},
    ]
    (root / "b" / "notes.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")


def _comparable(rows):
    return [{k: v for k, v in r.items() if k != "vector"} for r in rows]


def test_reingest_equals_fresh_ingest(tmp_path, rag_factory):
    tree = tmp_path / "tree"
    _write_tree(tree)
    rag = rag_factory(tmp_path / "home1", rerank=False)
    first = rag.ingest([tree])
    assert first.ok and first.added == 7

    _edit_tree(tree)
    report = rag.ingest([tree])
    assert report.ok, report.problems
    assert report.added == 1            # five.md
    assert report.updated == 2          # one.md, record r1
    assert report.deleted == 2          # two.txt, record r3
    assert report.acl_updated == 2      # three.md, four.md (r2 carries its own ACL)
    assert report.unchanged == 1        # r2
    assert report.chunks_written == 3   # only new or changed documents were embedded

    fresh = rag_factory(tmp_path / "home2", rerank=False)
    assert fresh.ingest([tree]).ok
    got = rag.catalog.dump("default")
    want = fresh.catalog.dump("default")
    assert _comparable(got) == _comparable(want)
    for g, w in zip(got, want, strict=True):
        assert np.allclose(g["vector"], w["vector"], atol=1e-5)

    for principal in [Principal("carl"), Principal("x", frozenset({"alpha"})),
                      Principal("y", frozenset({"beta"}))]:
        for q in ["Where is the centrifuge?", "When does the backup run?", "printer"]:
            a = rag.query(q, principal, k=4, generate=False)
            b = fresh.query(q, principal, k=4, generate=False)
            assert [(h.document_key, h.chunk_index) for h in a.hits] == \
                   [(h.document_key, h.chunk_index) for h in b.hits]
            assert np.allclose([h.score for h in a.hits], [h.score for h in b.hits], atol=1e-4)


def test_acl_change_applies_without_reembedding(tmp_path, rag_factory):
    tree = tmp_path / "tree"
    _write_tree(tree)
    rag = rag_factory(tmp_path / "home", rerank=False)
    rag.ingest([tree])
    carl = Principal("carl")
    assert not rag.query("microscope", carl, generate=False).hits
    (tree / "b" / ".rag-acl.toml").write_text('allow = ["user:carl"]\n')
    report = rag.ingest([tree])
    # three.md, four.md and the records r1, r3 that inherit the file's ACL
    assert report.chunks_written == 0 and report.acl_updated == 4
    hits = rag.query("microscope", carl, k=3, generate=False).hits
    assert hits and all(h.document_key.startswith(str(tree / "b")) for h in hits)
    beta = Principal("y", frozenset({"beta"}))
    assert not any(h.document_key.startswith(str(tree / "b" / "three.md"))
                   for h in rag.query("microscope", beta, generate=False).hits)
