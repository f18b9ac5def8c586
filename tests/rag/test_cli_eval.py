"""`rag eval` as a user runs it: a real subprocess over a real ingested corpus; exit codes and outputs."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rag.test_experiments_sets import make_beir

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

RAG = [sys.executable, "-c", "from rag.cli import main; main()"]


def _run(args, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    return subprocess.run(RAG + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model_cache):
    """A corpus with a group-only folder, ingested by `rag ingest`, and a question file for it."""
    home = tmp_path_factory.mktemp("eval-home")
    (home / "models").symlink_to(model_cache, target_is_directory=True)
    root = tmp_path_factory.mktemp("eval-corpus")
    (root / "team").mkdir()
    (root / "team" / ".rag-acl.toml").write_text('allow = ["group:team"]\n')
    (root / "team" / "plan.md").write_text("# Plan\n\nThe team meets in room T-900 on Fridays.\n")
    (root / ".rag-acl.toml").write_text('allow = ["public"]\n')
    (root / "open.md").write_text("# Open\n\nThe cafeteria opens at 08:00 every weekday.\n")
    done = _run(["ingest", root], home)
    assert done.returncode == 0, done.stderr
    questions = root.parent / "questions.jsonl"
    rows = [{"question": "Where does the team meet?", "user": "tess", "groups": ["team"], "sources": ["team/plan.md"],
             "expected": "T-900"},
            {"question": "Where does the team meet?", "user": "olga", "sources": ["team/plan.md"]},
            {"question": "When does the cafeteria open?", "user": "olga", "relevant": ["open.md"]}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return home, root, questions


def test_json_and_csv_with_two_configurations(setup, tmp_path):
    home, root, questions = setup
    out = _run(["eval", "--questions", questions, "--root", root, "--config", "mode=keyword,rerank=off",
                "--config", "mode=keyword,rerank=off,k=1,name=top one", "--json", "-", "--csv", tmp_path / "rows.csv"],
               home)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    summary = {s["config"]: s for s in report["summary"]}
    assert list(summary) == ["keyword, k=5", "top one"]
    # olga may not read the team's plan (its sidecar): that question must be refused, not missed
    assert summary["keyword, k=5"]["should_refuse"] == 1 and summary["keyword, k=5"]["answerable"] == 2
    assert summary["keyword, k=5"]["recall@1"] == 1.0 and summary["keyword, k=5"]["leaks"] == 0
    assert summary["top one"]["recall@3"] is None  # undefined above k, not zero
    assert len(report["rows"]) == 6
    with (tmp_path / "rows.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and rows[0]["retrieved"].startswith("team/plan.md")
    assert "rag eval: per configuration" in out.stderr  # the table goes to stderr when stdout is data


def test_a_leak_fails_the_run(setup):
    home, root, _ = setup
    q = root.parent / "leaky.jsonl"
    # The set says olga must never see the cafeteria page; it is public, so it comes back.
    q.write_text(json.dumps({"question": "When does the cafeteria open?", "user": "olga", "sources": ["team/plan.md"],
                             "forbidden": ["open.md"]}) + "\n")
    out = _run(["eval", "-q", q, "--root", root, "--config", "mode=keyword,rerank=off"], home)
    assert out.returncode == 1, out.stderr
    assert "1 leaked source(s)" in out.stderr and "olga asked 'When does the cafeteria open?': open.md" in out.stderr
    assert "leaks" in out.stdout  # the table still shows


def test_usage_errors_exit_2_with_a_hint(setup):
    home, root, questions = setup
    no_root = _run(["eval", "--questions", questions], home)
    assert no_root.returncode == 2 and "pass --root DIR" in no_root.stderr
    bad = _run(["eval", "--questions", questions, "--root", root, "--config", "topk=3"], home)
    assert bad.returncode == 2 and "key among" in bad.stderr
    ks = _run(["eval", "--questions", questions, "--root", root, "--ks", "five"], home)
    assert ks.returncode == 2 and "--ks takes whole numbers" in ks.stderr
    helped = _run(["eval", "--help"], home)
    assert helped.returncode == 0 and "BEIR" in helped.stdout and "rerank (on/off)" in helped.stdout


def test_a_beir_folder(setup, tmp_path):
    home, _, _ = setup
    folder = make_beir(tmp_path / "tiny-beir")
    out = _run(["eval", "--questions", folder, "--config", "mode=keyword,rerank=off,k=3", "--csv", "-"], home)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(out.stdout.splitlines()))
    assert {r["question_id"] for r in rows} == {"q1", "q2"}
    assert next(r for r in rows if r["question_id"] == "q2")["recall@3"] == "1.0"


def test_retrieval_setting_keys(setup):
    home, root, questions = setup
    out = _run(["eval", "-q", questions, "--root", root, "--config", "mode=hybrid,rerank=off",
                "--config", "mode=hybrid,rerank=off,dense_feedback=off,max_hits_per_document=2", "--json", "-"], home)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [s["config"] for s in report["summary"]] == [
        "hybrid, k=5", "hybrid, k=5, dense feedback off, max 2 per document"]
    settings = {(r["config"], r["dense_feedback"], r["max_hits_per_document"]) for r in report["rows"]}
    assert settings == {("hybrid, k=5", True, 1), ("hybrid, k=5, dense feedback off, max 2 per document", False, 2)}
    bad = _run(["eval", "-q", questions, "--root", root, "--config", "max_hits_per_document=-2"], home)
    assert bad.returncode == 2 and "max_hits_per_document must be a whole number between 0 and 100" in bad.stderr
    helped = _run(["eval", "--help"], home)
    assert "dense_feedback (on/off" in helped.stdout and "max_hits_per_document" in helped.stdout
    assert "page_evidence" in helped.stdout
