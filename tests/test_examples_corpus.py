"""Checks of the sample corpus in examples/lab-docs and the labelled questions that use it.

The demo and the end-to-end tests rely on this corpus: every supported format, one area per
group plus a public one, sidecar ACLs that parse, and planted facts that only the intended
users can read. The ACL resolver below is a deliberately tiny, independent re-implementation
of the sidecar rules, so a mistake in the corpus is not hidden by a mistake in permissions/.
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ROOT = EXAMPLES / "lab-docs"
QUESTIONS = EXAMPLES / "questions.jsonl"
SIDECAR = ".rag-acl.toml"
FORMATS = (".md", ".txt", ".html", ".pdf", ".docx", ".jsonl")

# The demo users (examples/README.md); erin is a second genomics member for leak tests.
USERS: dict[str, tuple[str, ...]] = {
    "alice": ("genomics",),
    "bob": ("imaging",),
    "carol": ("hpc-admins",),
    "dave": (),
    "erin": ("genomics",),
}
EVERYONE = frozenset(USERS)

# Planted fact -> the demo users who may read at least one document that contains it.
PLANTED: dict[str, frozenset[str]] = {
    "gpu01-gpu08": EVERYONE,
    "QOSMaxGRESPerJob": EVERYONE,
    "11 March 2025": EVERYONE,
    "ACC-REQ-7": EVERYONE,
    "10 April 2025": EVERYONE,  # a public record inside the genomics JSONL file
    "cryoem-res": frozenset({"bob"}),
    "KRIOS-2": frozenset({"bob"}),
    "EPU-E1042": frozenset({"bob"}),
    "SC-88213": frozenset({"bob"}),
    "niqb-imaging-dtn": frozenset({"bob"}),
    "INC-2291": frozenset({"carol"}),
    "HBM": frozenset({"carol"}),
    "CHG-1187": frozenset({"carol"}),
    "7.10.30": frozenset({"carol"}),
    "secret/hpc/breakglass": frozenset({"carol"}),
    "SN-HX-10458": frozenset({"carol"}),
    "ib-sw03": frozenset({"carol"}),
    "FRZ-80-B": frozenset({"alice", "erin"}),
    "-65 C": frozenset({"alice", "erin"}),
    "GEN-4471-R01": frozenset({"alice", "erin"}),
    "E-VCF-017": frozenset({"alice", "erin"}),
    "ENSG00000141510": frozenset({"alice", "erin"}),
    "SPATIAL-22": frozenset({"alice", "erin", "bob"}),
    "EMB-7731": frozenset({"alice"}),
    "ENSG00000133703": frozenset({"alice"}),
    "band G7": frozenset({"alice"}),
}

_ENTRY = re.compile(r"^(public|(user|group):[A-Za-z0-9_][A-Za-z0-9_.@+-]*)$")


def glob_matches(pattern: str, rel: str) -> bool:
    """Sidecar globs: `*` and `?` stay in one path segment, `**` spans directories, and a
    pattern that matches a directory covers everything below it."""
    regex = re.escape(pattern.strip("/"))
    regex = regex.replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
    regex = regex.replace("\0", ".*")
    return re.fullmatch(f"{regex}(/.*)?", rel) is not None


def tokens(user: str, groups: tuple[str, ...] | list[str]) -> frozenset[str]:
    return frozenset({"public", f"user:{user}"} | {f"group:{g}" for g in groups})


def can_read(user: str, acl: frozenset[str]) -> bool:
    return not tokens(user, USERS[user]).isdisjoint(acl)


def document_files() -> list[Path]:
    """Every file that `rag ingest examples/lab-docs` would ingest (sidecars excluded)."""
    return sorted(p for p in ROOT.rglob("*") if p.is_file() and p.name != SIDECAR)


def sidecar_acl(path: Path) -> frozenset[str]:
    """ACL of a file: the nearest sidecar up the tree; its last matching rule, else its allow."""
    directory = path.parent
    while True:
        sidecar = directory / SIDECAR
        if sidecar.is_file():
            config = tomllib.loads(sidecar.read_text())
            rel = path.relative_to(directory).as_posix()
            acl = config["allow"]
            for rule in config.get("rule", []):
                if glob_matches(rule["match"], rel):
                    acl = rule["allow"]
            return frozenset(acl)
        if directory == ROOT:
            return frozenset()  # no sidecar at all: nobody (POSIX is not modelled here)
        directory = directory.parent


def jsonl_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def extract_text(path: Path) -> str:
    if path.suffix == ".pdf":
        pdfminer = pytest.importorskip("pdfminer.high_level")
        return pdfminer.extract_text(str(path))
    if path.suffix == ".docx":
        docx = pytest.importorskip("docx")
        document = docx.Document(str(path))
        cells = [c.text for t in document.tables for row in t.rows for c in row.cells]
        return "\n".join([p.text for p in document.paragraphs] + cells)
    text = path.read_text()
    if path.suffix == ".html":
        text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return text


@cache
def documents() -> dict[str, tuple[frozenset[str], str]]:
    """Document key (path relative to ROOT, or FILE.jsonl#ID) -> (ACL, text)."""
    docs: dict[str, tuple[frozenset[str], str]] = {}
    for path in document_files():
        rel = path.relative_to(ROOT).as_posix()
        acl = sidecar_acl(path)
        if path.suffix == ".jsonl":
            for record in jsonl_records(path):
                record_acl = frozenset(record["acl"]) if "acl" in record else acl
                text = f"{record.get('title', '')}\n{record['text']}"
                docs[f"{rel}#{record['id']}"] = (record_acl, text)
        else:
            docs[rel] = (acl, extract_text(path))
    return docs


def squash(text: str) -> str:
    return " ".join(text.split())


def load_questions() -> list[dict]:
    return [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------ corpus


def test_every_format_is_present_at_least_twice_and_nothing_else():
    files = document_files()
    counts = {fmt: sum(p.suffix == fmt for p in files) for fmt in FORMATS}
    assert all(n >= 2 for n in counts.values()), counts
    others = [p.relative_to(ROOT).as_posix() for p in files if p.suffix not in FORMATS]
    assert others == [], f"lab-docs may only hold ingestible documents: {others}"
    assert 20 <= len(files) <= 28


@pytest.mark.parametrize("entry", ["public", "group:genomics", "group:imaging", "group:hpc-admins"])
def test_each_area_has_documents(entry):
    readable = [key for key, (acl, _) in documents().items() if entry in acl]
    assert len(readable) >= 3, f"{entry} can read only {readable}"


def test_documents_are_compact_but_not_empty():
    for path in document_files():
        if path.suffix == ".jsonl":
            continue
        words = len(extract_text(path).split())
        assert 150 <= words <= 650, f"{path.relative_to(ROOT)} has {words} words"


@pytest.mark.parametrize(
    "sidecar", sorted(ROOT.rglob(SIDECAR)), ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_sidecar_parses_with_valid_entries(sidecar):
    config = tomllib.loads(sidecar.read_text())
    assert set(config) <= {"allow", "rule"}, f"unknown keys {set(config)}"
    assert isinstance(config["allow"], list)
    assert all(isinstance(e, str) and _ENTRY.match(e) for e in config["allow"]), config["allow"]
    for rule in config.get("rule", []):
        assert set(rule) == {"match", "allow"}, rule
        assert isinstance(rule["match"], str) and not rule["match"].startswith("/")
        assert rule["allow"] and all(_ENTRY.match(e) for e in rule["allow"]), rule
        matched = [
            p
            for p in sidecar.parent.rglob("*")
            if p.is_file()
            and p.name != SIDECAR
            and glob_matches(rule["match"], p.relative_to(sidecar.parent).as_posix())
        ]
        assert matched, f"rule {rule['match']!r} in {sidecar} matches no file"


@pytest.mark.parametrize(
    ("pattern", "rel", "expected"),
    [
        ("restricted/*.md", "restricted/a.md", True),
        ("restricted/*.md", "restricted/deeper/a.md", False),
        ("restricted/*.md", "other/restricted/a.md", False),
        ("**/*.pdf", "a/b/c.pdf", True),
        ("restricted", "restricted/deeper/a.md", True),
    ],
)
def test_glob_semantics_of_the_test_resolver(pattern, rel, expected):
    assert glob_matches(pattern, rel) is expected


def test_root_sidecar_denies_everyone_by_default():
    assert tomllib.loads((ROOT / SIDECAR).read_text()) == {"allow": []}
    assert sidecar_acl(ROOT / "stray-file.md") == frozenset()


def test_restricted_note_is_for_alice_only():
    assert sidecar_acl(ROOT / "genomics/restricted/embargoed-results.md") == {"user:alice"}
    assert sidecar_acl(ROOT / "genomics/freezer-inventory.txt") == {"group:genomics"}
    assert sidecar_acl(ROOT / "imaging/protocols/grid-preparation.md") == {"group:imaging"}


def test_jsonl_records_are_valid():
    mixed = []
    for path in ROOT.rglob("*.jsonl"):
        records = jsonl_records(path)
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)), f"duplicate ids in {path}"
        for r in records:
            assert set(r) <= {"id", "text", "title", "acl", "metadata"}, r
            assert isinstance(r["id"], str) and r["id"] and "#" not in r["id"]
            assert isinstance(r["text"], str) and len(r["text"].split()) >= 30
            assert isinstance(r.get("title", ""), str)
            assert isinstance(r.get("metadata", {}), dict)
            if "acl" in r:
                assert r["acl"] and all(_ENTRY.match(e) for e in r["acl"]), r["acl"]
        with_acl = sum("acl" in r for r in records)
        if len(records) >= 6 and 0 < with_acl < len(records):
            mixed.append(path)
    assert mixed, "need a JSONL file of ~6 records where some carry their own acl and some inherit"


def test_planted_facts_are_visible_to_exactly_the_intended_users():
    for token, expected in PLANTED.items():
        holders = [key for key, (_, text) in documents().items() if token in squash(text)]
        assert holders, f"{token!r} is planted nowhere"
        readers = {u for u in USERS for key in holders if can_read(u, documents()[key][0])}
        assert readers == expected, f"{token!r} in {holders} is readable by {sorted(readers)}"


def test_binary_documents_match_their_generator(tmp_path):
    script = EXAMPLES / "make_binary_docs.py"
    spec = importlib.util.spec_from_file_location("make_binary_docs", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = set(module.DOCS)
    on_disk = {
        p.relative_to(ROOT).as_posix() for p in document_files() if p.suffix in (".pdf", ".docx")
    }
    assert generated == on_disk
    for rel in sorted(generated):
        if rel.endswith(".pdf"):  # our own writer: byte-identical
            assert module.build(rel) == (ROOT / rel).read_bytes(), f"rerun {script.name} ({rel})"
            text = squash(extract_text(ROOT / rel))
            assert squash(module.DOCS[rel][0]) in text
        else:  # python-docx output may differ in bytes between versions; compare the text
            pytest.importorskip("docx")
            fresh = tmp_path / Path(rel).name
            fresh.write_bytes(module.build(rel))
            assert extract_text(fresh) == extract_text(ROOT / rel), f"rerun {script.name} ({rel})"


# --------------------------------------------------------------------------------- questions


def test_questions_are_valid_and_consistent_with_the_acls():
    questions = load_questions()
    assert len(questions) >= 20
    docs = documents()
    for q in questions:
        where = q["question"], q["user"]
        assert set(q) <= {"question", "user", "groups", "relevant", "expect_contains", "forbidden"}
        assert isinstance(q["question"], str) and q["question"].strip()
        assert q["user"] in USERS and tuple(q["groups"]) == USERS[q["user"]], where
        for key in q["relevant"]:
            assert key in docs, f"relevant {key!r} does not exist {where}"
            assert can_read(q["user"], docs[key][0]), f"{q['user']} may not read relevant {key}"
        for key in q["forbidden"]:
            assert key in docs, f"forbidden {key!r} does not exist {where}"
            assert not can_read(q["user"], docs[key][0]), f"{q['user']} CAN read forbidden {key}"
        if "expect_contains" in q:
            assert q["relevant"], where
            assert any(q["expect_contains"] in squash(docs[k][1]) for k in q["relevant"]), where


def test_questions_show_different_answers_for_the_same_question():
    by_question: dict[str, set[str]] = {}
    for q in load_questions():
        by_question.setdefault(q["question"], set()).add(q.get("expect_contains", ""))
    differing = [text for text, answers in by_question.items() if len(answers) > 1]
    assert len(differing) >= 3, differing


def test_questions_include_leak_probes_and_both_search_styles():
    questions = load_questions()
    probes = [q for q in questions if not q["relevant"] and q["forbidden"]]
    assert len(probes) >= 4, "need questions whose only answers are forbidden to the asker"
    code = re.compile(r"[A-Z]{2,}[A-Za-z]*-[A-Z0-9]|ENSG\d+|QOS[A-Za-z]+")
    keyword = [q for q in questions if code.search(q["question"])]
    assert len(keyword) >= 3, "need exact-keyword questions (error codes, gene IDs)"
