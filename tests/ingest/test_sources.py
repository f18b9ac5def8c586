"""Walking the corpus: order, skipping, explicit files, JSONL records and their problems."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from pathlib import Path

import pytest

from ingest.sources import SourceItem, SourceProblem, scan_roots, walk_sources
from rag.errors import ConfigError
from tests.unprivileged import run_unprivileged, searchable_dir


def write(path: Path, data: str | bytes = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def items(paths, **kw) -> list[SourceItem]:
    out = list(walk_sources(paths, **kw))
    assert all(isinstance(x, SourceItem) for x in out), out
    return out


def problems(paths, **kw) -> list[SourceProblem]:
    return [x for x in walk_sources(paths, **kw) if isinstance(x, SourceProblem)]


def test_walk_is_sorted_recursive_and_skips_hidden_and_unsupported(tmp_path: Path) -> None:
    for rel in ["b.md", "a.txt", "sub/z.html", "sub/a.pdf", "c.docx", "d.markdown", "e.htm"]:
        write(tmp_path / rel)
    write(tmp_path / ".hidden.md")
    write(tmp_path / ".git" / "notes.md")
    write(tmp_path / ".rag-acl.toml", 'allow = ["public"]\n')
    write(tmp_path / "image.png", b"\x89PNG")
    write(tmp_path / "Makefile")
    got = [Path(i.key).relative_to(tmp_path).as_posix() for i in items([tmp_path])]
    assert got == ["a.txt", "b.md", "c.docx", "d.markdown", "e.htm", "sub/a.pdf", "sub/z.html"]


def test_file_item_fields(tmp_path: Path) -> None:
    p = write(tmp_path / "doc.md", "# Hi\n")
    (item,) = items([tmp_path])
    assert item.key == str(p.resolve()) and item.path == p.resolve()
    assert item.kind == "file"
    assert item.content_hash == hashlib.sha256(b"# Hi\n").hexdigest()
    assert item.acl_origin == "posix"
    assert item.title is None and item.text is None and item.metadata == {}


def test_suffix_is_case_insensitive(tmp_path: Path) -> None:
    write(tmp_path / "REPORT.PDF")
    assert [i.path.name for i in items([tmp_path])] == ["REPORT.PDF"]


def test_single_file_and_explicit_unsupported(tmp_path: Path) -> None:
    md = write(tmp_path / "one.md")
    csv = write(tmp_path / "table.csv")
    noext = write(tmp_path / "README")
    out = list(walk_sources([md, csv, noext]))
    assert isinstance(out[0], SourceItem) and out[0].key == str(md)
    assert isinstance(out[1], SourceProblem) and out[1].reason.startswith(
        "unsupported file type .csv")
    assert isinstance(out[2], SourceProblem)
    assert out[2].reason.startswith("unsupported file type (no suffix)")


def test_missing_path_fails_before_anything_is_yielded(tmp_path: Path) -> None:
    write(tmp_path / "a.md")
    with pytest.raises(ConfigError, match="path not found: .*nope"):
        walk_sources([tmp_path, tmp_path / "nope"])  # raised by the call, not by iterating
    with pytest.raises(ConfigError, match="path not found"):
        scan_roots([tmp_path / "nope"])
    with pytest.raises(ConfigError, match="no paths"):
        scan_roots([])


def test_overlapping_roots_yield_each_file_once(tmp_path: Path) -> None:
    write(tmp_path / "sub" / "a.md")
    write(tmp_path / "b.md")
    keys = [i.key for i in items([tmp_path, tmp_path / "sub", tmp_path / "sub" / "a.md"])]
    assert sorted(keys) == keys and len(keys) == len(set(keys)) == 2
    assert scan_roots([tmp_path, str(tmp_path)]) == [tmp_path.resolve()]


def test_symlinks_skipped_unless_followed(tmp_path: Path) -> None:
    outside = write(tmp_path / "outside" / "target.md")
    root = tmp_path / "root"
    write(root / "real.md")
    (root / "link.md").symlink_to(outside)
    (root / "linkdir").symlink_to(outside.parent, target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)
    assert [i.path.name for i in items([root])] == ["real.md"]
    followed = items([root], follow_symlinks=True)
    # target.md is reached through link.md and linkdir/ but yielded once; the loop ends.
    assert sorted(i.path.name for i in followed) == ["real.md", "target.md"]


def test_fifo_inside_directory_is_skipped(tmp_path: Path) -> None:
    write(tmp_path / "a.md")
    os.mkfifo(tmp_path / "pipe.md")  # reading it would block forever
    assert [i.path.name for i in items([tmp_path])] == ["a.md"]


def _deny_open(monkeypatch: pytest.MonkeyPatch, denied: Path) -> None:
    # Tests may run as root, for whom chmod 000 changes nothing: make this one path's open()
    # fail exactly as it does for an ordinary user.
    real_open = pathlib.Path.open

    def fake_open(self, *args, **kwargs):
        if self.resolve() == denied.resolve():
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", fake_open)


def test_unreadable_file_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "a.md")
    secret = write(tmp_path / "b.md")
    write(tmp_path / "c.md")
    _deny_open(monkeypatch, secret)
    out = list(walk_sources([tmp_path]))
    assert [type(x).__name__ for x in out] == ["SourceItem", "SourceProblem", "SourceItem"]
    assert out[1].key == str(secret) and out[1].reason == "cannot read file: Permission denied"


_WALK_AS_NOBODY = (
    "import json, sys\nfrom pathlib import Path\nfrom ingest.sources import SourceItem, walk_sources",
    "out = [[type(x).__name__, Path(x.key).name, x.reason if type(x).__name__ == 'SourceProblem' else\n"
    "        [sorted(x.acl), x.acl_origin, x.acl_error]] for x in walk_sources([Path(sys.argv[1])])]\n"
    "print(json.dumps(out))\n",
)


def _walk_unprivileged(root: Path) -> list:
    """walk_sources over `root` with real permission denials, as root too (tests/unprivileged.py)."""
    out = run_unprivileged(*_WALK_AS_NOBODY, str(root))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_unreadable_file_for_real() -> None:
    with searchable_dir() as d:
        write(d / "a.md").chmod(0o644)
        write(d / "b.md").chmod(0)
        out = _walk_unprivileged(d)
    assert [x[:2] for x in out] == [["SourceItem", "a.md"], ["SourceProblem", "b.md"]]
    assert out[1][2] == "cannot read file: Permission denied"


def test_unreadable_sidecar_blocks_its_files_for_real() -> None:
    # Its files are readable, but what the sidecar says is unknown: nobody may read them, never POSIX.
    with searchable_dir() as d:
        write(d / "open" / "a.md").chmod(0o644)
        write(d / "locked" / "b.md").chmod(0o644)
        for sub in ("open", "locked"):
            (d / sub).chmod(0o755)
        write(d / "locked" / ".rag-acl.toml", 'allow = ["public"]\n').chmod(0)
        out = _walk_unprivileged(d)
    (b,) = [x for x in out if x[1] == "b.md"]
    assert b[0] == "SourceItem" and b[2][:2] == [[], "error"]
    assert ".rag-acl.toml" in b[2][2] and "cannot read: Permission denied" in b[2][2]
    (a,) = [x for x in out if x[1] == "a.md"]  # beside it, a file without a sidecar has its POSIX ACL
    assert a[0] == "SourceItem" and "public" in a[2][0] and a[2][1:] == ["posix", None]


# --------------------------------------------------------------------------------- JSONL


def jsonl(path: Path, *lines: object) -> Path:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return write(path, text)


def test_jsonl_records(tmp_path: Path) -> None:
    f = jsonl(
        tmp_path / "faq.jsonl",
        {"id": "q1", "text": "Reset your key at the portal.", "title": "Keys",
         "metadata": {"category": "accounts"}},
        "",
        {"id": 7, "text": "Use sbatch.", "acl": ["group:hpc", "user:alice"]},
    )
    out = items([tmp_path])
    assert [i.key for i in out] == [f"{f}#q1", f"{f}#7"]
    q1, r7 = out
    assert q1.kind == "record" and q1.path == f
    assert q1.title == "Keys" and q1.text == "Reset your key at the portal."
    assert q1.metadata == {"category": "accounts"}
    assert q1.acl_origin == "posix"  # no "acl" field: the .jsonl file's own ACL
    assert r7.acl == frozenset({"group:hpc", "user:alice"}) and r7.acl_origin == "record"
    assert r7.title is None and r7.metadata == {}


def test_record_hash_is_canonical_and_ignores_acl(tmp_path: Path) -> None:
    a = jsonl(tmp_path / "a" / "x.jsonl",
              '{"id": "1", "text": "T", "title": "t", "metadata": {"a": 1, "b": 2}}')
    b = jsonl(tmp_path / "b" / "x.jsonl",
              '{"metadata":{"b":2,"a":1},"title":"t","text":"T","id":"1","acl":["public"]}')
    c = jsonl(tmp_path / "c" / "x.jsonl", '{"id": "1", "text": "T changed", "title": "t"}')
    (ia,), (ib,), (ic,) = items([a]), items([b]), items([c])
    assert ia.content_hash == ib.content_hash != ic.content_hash


def test_jsonl_bad_lines_are_reported_and_others_go_on(tmp_path: Path) -> None:
    f = write(tmp_path / "data.jsonl", b"\n".join([
        b'{"id": "ok1", "text": "fine"}',
        b'{"id": "x", "text": "unterminated',
        b'{"text": "no id"}',
        b'{"id": "", "text": "empty id"}',
        b'{"id": "e", "text": "   "}',
        b'{"id": "a", "text": "t", "acl": ["admins"]}',
        b'{"id": "ok1", "text": "again"}',
        b'["not", "an", "object"]',
        b'{"id": "u", "text": "caf\xe9"}',
        b'{"id": "k", "text": "t", "acls": ["public"]}',
        b'{"id": true, "text": "bool id"}',
        b'   ',
        b'{"id": "ok2", "text": "also fine"}',
    ]))
    out = list(walk_sources([f]))
    # A record whose only fault is its ACL is stored readable by nobody (acl_error says why).
    assert [x.key for x in out if isinstance(x, SourceItem)] == [f"{f}#ok1", f"{f}#a", f"{f}#ok2"]
    bad_acl = next(x for x in out if x.key == f"{f}#a")
    assert bad_acl.acl == frozenset() and "line 6: bad 'acl'" in bad_acl.acl_error
    probs = {p.key: p.reason for p in out if isinstance(p, SourceProblem)}
    # A line that still names its record speaks for that record; others, by line number.
    expect = {
        2: "invalid JSON", 3: "missing or empty 'id'", 4: "missing or empty 'id'",
        "e": "missing or empty 'text'", "ok1": "duplicate id 'ok1' (first on line 1)",
        8: "expected a JSON object", 9: "invalid UTF-8", "k": "unknown keys ['acls']",
        11: "missing or empty 'id'",
    }
    line = {"e": 5, "k": 10, "ok1": 7}
    assert set(probs) == {f"{f}#{n}" if isinstance(n, str) else f"{f}:{n}" for n in expect}
    for n, fragment in expect.items():
        reason = probs[f"{f}#{n}" if isinstance(n, str) else f"{f}:{n}"]
        assert reason.startswith(f"line {line.get(n, n)}: ") and fragment in reason, reason
        assert "\n" not in reason
    assert all(p.path == f for p in out if isinstance(p, SourceProblem))


def test_jsonl_records_inherit_sidecar_acl(tmp_path: Path) -> None:
    write(tmp_path / ".rag-acl.toml", 'allow = ["group:genomics"]\n')
    f = jsonl(tmp_path / "meetings.jsonl", {"id": "m1", "text": "Minutes."},
              {"id": "m2", "text": "Private.", "acl": ["user:alice"]})
    m1, m2 = items([tmp_path])
    assert m1.acl == frozenset({"group:genomics"})
    assert m1.acl_origin == f"sidecar:{tmp_path / '.rag-acl.toml'}"
    assert m2.acl == frozenset({"user:alice"}) and m2.acl_origin == "record"
    assert m1.path == f


def test_broken_sidecar_blocks_files_and_acl_less_records(tmp_path: Path) -> None:
    write(tmp_path / ".rag-acl.toml", 'allow = ["group:genomics"\n')  # bad TOML
    write(tmp_path / "doc.md", "# Doc\n")
    f = jsonl(tmp_path / "r.jsonl", {"id": "1", "text": "inherits"},
              {"id": "2", "text": "explicit", "acl": ["public"]})
    out = list(walk_sources([tmp_path]))
    # Their ACL cannot be determined: they come with an empty one (nobody) and the reason.
    doc = next(x for x in out if x.key == str(tmp_path / "doc.md"))
    assert isinstance(doc, SourceItem) and doc.acl == frozenset() and doc.acl_origin == "error"
    assert str(tmp_path / ".rag-acl.toml") in doc.acl_error
    rec1 = next(x for x in out if x.key == f"{f}#1")
    assert isinstance(rec1, SourceItem) and rec1.acl == frozenset() and ".rag-acl.toml" in rec1.acl_error
    rec2 = next(x for x in out if x.key == f"{f}#2")
    assert isinstance(rec2, SourceItem) and rec2.acl == frozenset({"public"})
    # Nothing fell back to POSIX.
    assert not [x for x in out if isinstance(x, SourceItem) and x.acl_origin == "posix"]


def test_unreadable_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = jsonl(tmp_path / "r.jsonl", {"id": "1", "text": "x"})
    _deny_open(monkeypatch, f)
    (p,) = list(walk_sources([tmp_path]))
    assert isinstance(p, SourceProblem) and p.key == str(f)
    assert p.reason == "cannot read file: Permission denied"
