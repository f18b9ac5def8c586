"""The PostgreSQL-manual question set: labels match the built corpus and its ACLs, and they hold."""

from __future__ import annotations

import html
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from permissions.models import Principal
from permissions.sources import AclResolver
from retrieval.evaluate import load_questions

EVAL_DIR = Path(__file__).resolve().parents[2] / "examples" / "eval" / "postgresql"
QUESTIONS = EVAL_DIR / "questions.jsonl"


def _builder():
    spec = importlib.util.spec_from_file_location("pgdocs_build_corpus", EVAL_DIR / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is being executed
    spec.loader.exec_module(module)
    return module


build = _builder()
needs_manual = pytest.mark.skipif(
    not (build.MANUAL / "index.html").is_file(),
    reason=f"Debian's PostgreSQL manual is not at {build.MANUAL}: {build.INSTALL_HINT} "
           "(scripts/setup.sh does it as root)")


def _labels() -> list[dict]:
    return [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]


def _page_text(path: Path) -> str:
    """What a reader sees: tags dropped, entities decoded, whitespace collapsed."""
    text = re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8"))
    return re.sub(r"\s+", " ", html.unescape(text))


def _documented_folders() -> dict[str, frozenset[str]]:
    """The README's ACL table: folder -> allow list, as a user reads it."""
    rows = re.findall(r"^\| `([a-z-]+)/` \|[^|]*\| ([^|]+) \|$", (EVAL_DIR / "README.md").read_text(), re.M)
    return {folder: frozenset(re.findall(r"`([^`]+)`", allow)) for folder, allow in rows}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pgdocs") / "corpus"
    build.build_corpus(root)
    return root


def test_the_set_is_big_enough_and_has_refusals_and_multi_page_answers():
    labels = _labels()
    assert len(labels) >= 45
    assert sum(1 for q in labels if not q["relevant"]) >= 8  # should refuse
    assert sum(1 for q in labels if len(q["sources"]) > 1) >= 5
    assert all(q["expected"] and q["sources"] for q in labels)
    # retrieval/evaluate.py reads the file as it is (the extra fields are ignored there).
    assert len(load_questions(QUESTIONS)) == len(labels)


@needs_manual
def test_every_source_page_exists_and_holds_the_expected_fact(corpus):
    for q in _labels():
        for source in q["sources"]:
            assert (corpus / source).is_file(), f"{source} (for {q['question']!r}) is not in the corpus"
        texts = [_page_text(corpus / s) for s in q["sources"]]
        assert any(q["expected"] in t for t in texts), f"{q['expected']!r} is in none of {q['sources']}"


@needs_manual
def test_relevant_and_forbidden_split_the_sources_by_what_the_asker_may_read(corpus):
    resolver = AclResolver(corpus)
    for q in _labels():
        asker = Principal(q["user"], frozenset(q["groups"]))
        readable = [s for s in q["sources"] if asker.can_read(resolver.resolve(corpus / s)[0])]
        assert q["relevant"] == readable, q["question"]
        assert q["forbidden"] == [s for s in q["sources"] if s not in readable], q["question"]


@needs_manual
def test_every_page_gets_the_groups_the_readme_documents(corpus):
    documented = _documented_folders()
    assert set(documented) == {a.folder for a in build.AREAS.values()}
    resolver = AclResolver(corpus)
    pages = sorted(corpus.rglob("*.html"))
    assert len(pages) > 1000  # the whole manual
    for page in pages:
        folder = page.relative_to(corpus).parts[0]
        assert resolver.resolve(page)[0] == documented[folder], page


def test_a_page_whose_part_is_unknown_is_readable_by_nobody(tmp_path):
    manual = tmp_path / "manual"
    manual.mkdir()
    up = '<a accesskey="u" href="{}">Up</a>'
    (manual / "index.html").write_text("<html>home</html>")
    (manual / "admin.html").write_text(up.format("index.html"))
    (manual / "auth-peer.html").write_text(up.format("admin.html"))
    (manual / "orphan.html").write_text(up.format("gone.html"))  # its parent is not in the manual
    (manual / "loop.html").write_text(up.format("loop.html"))
    placed = build.build_corpus(tmp_path / "corpus", manual)
    assert placed["auth-peer.html"] == "admin/auth-peer.html"
    assert placed["orphan.html"] == "orphan.html" and placed["loop.html"] == "loop.html"
    resolver = AclResolver(tmp_path / "corpus")
    assert resolver.resolve(tmp_path / "corpus" / "orphan.html")[0] == frozenset()
    assert resolver.resolve(tmp_path / "corpus" / "admin/auth-peer.html")[0] == frozenset({"group:dba"})


@needs_manual
def test_a_user_without_the_dba_group_cannot_retrieve_a_dba_page(tmp_path):
    from rag.pipeline import Rag
    from rag.settings import load_settings
    from retrieval.evaluate import source_key

    corpus = tmp_path / "corpus"
    build.build_corpus(corpus, pages=["auth-peer.html", "tutorial-fk.html", "sql-truncate.html"])
    rag = Rag(load_settings(home=tmp_path / "home"))
    try:
        rag.ingest([corpus], progress=False)
        retriever = rag.retriever(rerank=False)
        question = "what does peer authentication check"

        def pages(principal: Principal, mode: str) -> list[str]:
            hits = retriever.retrieve(question, principal, k=5, rerank=False, mode=mode).hits
            return [source_key(h.document_key, corpus) for h in hits]

        for mode in ("dense", "keyword"):
            # The positive control: with the group, the page is found first.
            assert pages(Principal("sam", frozenset({"dba"})), mode)[0] == "admin/auth-peer.html"
            for asker, may_read in ((Principal("pat"), ("public/",)),
                                    (Principal("dana", frozenset({"developers"})), ("public/", "sql-commands/"))):
                got = pages(asker, mode)
                assert "admin/auth-peer.html" not in got, (mode, asker)
                assert all(p.startswith(may_read) for p in got), (mode, asker, got)
        # Dense search ranks every readable chunk: pat gets the public page, never a developers' one.
        assert set(pages(Principal("pat"), "dense")) == {"public/tutorial-fk.html"}
    finally:
        rag.close()
