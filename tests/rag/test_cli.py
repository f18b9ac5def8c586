"""The `rag` command as a user runs it: a real subprocess, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

RAG = [sys.executable, "-c", "from rag.cli import main; main()"]


def _run(args, home: Path, env_extra: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", **(env_extra or {})}
    return subprocess.run(RAG + list(args), env=env, capture_output=True, text=True,
                          timeout=600, **kw)


@pytest.fixture(scope="module")
def home(tmp_path_factory, model_cache):
    home = tmp_path_factory.mktemp("cli-home")
    (home / "models").symlink_to(model_cache, target_is_directory=True)
    return home


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-corpus")
    (root / "team").mkdir()
    (root / "team" / ".rag-acl.toml").write_text('allow = ["group:team"]\n')
    (root / "team" / "plan.md").write_text("# Plan\n\nThe team meets in room T-900 on Fridays.\n")
    (root / "open.md").write_text("# Open\n\nThe cafeteria opens at 08:00 every weekday.\n")
    (root / "broken.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "empty.md").write_text("")
    (root / "bad.jsonl").write_text('{"id": "a", "text": "Record A is fine."}\n{not json\n')
    return root


def test_ingest_embeds_in_a_worker_process_where_the_setting_says_so(tmp_path, model_cache):
    # The command loads its embedder before the progress bar starts: that must be the ingest's
    # embedder (a worker process on a GPU by default, here forced), not the query embedder.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.md").write_text("# A\n\nThe centrifuge is booked on Mondays.\n")
    for in_worker in ("true", "false"):
        home = tmp_path / f"home-{in_worker}"
        home.mkdir()
        (home / "models").symlink_to(model_cache, target_is_directory=True)
        r = _run(["ingest", str(corpus), "--json"], home, env_extra={"RAG_INGEST_EMBED_PROCESS": in_worker})
        assert r.returncode == 0, r.stderr
        seconds = json.loads(r.stdout)["seconds"]
        assert ("embed_in_worker" in seconds) == (in_worker == "true"), seconds


def test_ingest_reports_bad_sources_and_goes_on(home, corpus):
    r = _run(["ingest", str(corpus), "--json"], home)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    reasons = {Path(p["source"].split(":")[0]).name: p["reason"] for p in out["problems"]}
    assert set(reasons) == {"broken.pdf", "binary.txt", "empty.md", "bad.jsonl"}, reasons
    assert "PDF" in reasons["broken.pdf"] and "empty" in reasons["empty.md"]
    assert "binary" in reasons["binary.txt"] and "line 2" in reasons["bad.jsonl"]
    assert out["added"] == 3  # plan.md, open.md, the good JSONL record
    # Re-running changes nothing that was ingested and still reports the bad ones.
    r2 = _run(["ingest", str(corpus), "--json"], home)
    out2 = json.loads(r2.stdout)
    assert r2.returncode == 1 and out2["unchanged"] == 3 and out2["chunks_written"] == 0


def test_query_respects_groups(home, corpus):
    _run(["ingest", str(corpus)], home)
    assert _run(["users", "add", "tina", "--group", "team"], home).returncode == 0
    assert _run(["users", "add", "otto"], home).returncode == 0
    q = ["query", "Where does the team meet?", "--no-generate", "--json", "--k", "3"]
    tina = json.loads(_run(q + ["--as", "tina"], home).stdout)
    otto = json.loads(_run(q + ["--as", "otto"], home).stdout)
    assert any("T-900" in c["text"] for c in tina["citations"])
    assert not any("T-900" in c["text"] for c in otto["citations"])
    assert set(tina["timings_ms"]) >= {"embed", "search", "rerank", "total"}


def test_query_json_keeps_the_raw_score_and_people_see_relevance(home, corpus):
    import math

    from rag.query_client import loading_dominates

    _run(["ingest", str(corpus)], home)
    _run(["users", "add", "tina", "--group", "team"], home)
    q = ["query", "Where does the team meet?", "--no-generate", "--k", "2", "--as", "tina"]
    r = _run(q + ["--json"], home)
    out = json.loads(r.stdout)
    for c in out["citations"]:
        assert c["relevance"] == pytest.approx(1 / (1 + math.exp(-c["score"])), abs=1e-4)
        assert c["rank"] in (1, 2)
    # The load hint follows the timings this run measured (a fresh process loads both models).
    timings = {k: v / 1000 for k, v in out["timings_ms"].items()}
    assert timings["load_embedder"] > 0 and timings["load_reranker"] > 0
    assert ("hint:" in r.stderr) == loading_dominates(timings), r.stderr
    if "hint:" in r.stderr:
        assert "rag serve" in r.stderr and "--server" in r.stderr
    human = [line for line in _run(q, home).stdout.splitlines() if line.startswith("[")]
    assert human and all(re.search(r"\(chunk \d+, relevance [01]\.\d\d\)$", line) for line in human), human
    unranked = _run(q + ["--no-rerank"], home).stdout.splitlines()
    cited = [line for line in unranked if line.startswith("[")]
    assert cited and all("rank " in line and "relevance" not in line for line in cited), unranked


@pytest.mark.parametrize("args, message", [
    (["ingest", "/no/such/path"], "path not found: /no/such/path"),
    (["query", "hi", "--as", "otto", "--collection", "nope"], "unknown collection 'nope'"),
    (["query", "hi", "--as", "nobody-at-all"], "unknown user 'nobody-at-all'"),
    (["query", "  ", "--as", "otto"], "empty question"),
    (["query", "hi", "--as", "otto", "--k", "0"], "k must be between 1 and 100"),
])
def test_bad_input_is_one_line_and_nonzero(home, corpus, args, message):
    _run(["users", "add", "otto"], home)
    r = _run(args, home)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and message in lines[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_keys_create_list_revoke(home):
    r = _run(["keys", "create", "--user", "kim", "--group", "team"], home)
    key = r.stdout.strip()
    assert r.returncode == 0 and key.startswith("rag_")
    listing = _run(["keys", "list"], home).stdout
    assert "kim" in listing and key not in listing
    key_id = key.split("_")[1]
    assert _run(["keys", "revoke", key_id], home).returncode == 0
    assert "revoked" in _run(["keys", "list"], home).stdout


def test_keys_list_shows_the_groups_a_request_gets_now(home):
    _run(["users", "add", "lena", "--group", "team", "--group", "lab"], home)
    full = _run(["keys", "create", "--user", "lena"], home).stdout.strip()
    scoped = _run(["keys", "create", "--user", "lena", "--scope", "lab"], home).stdout.strip()
    _run(["users", "add", "lena", "--group", "lab"], home)  # lena leaves team
    rows = {line.split()[0]: line for line in _run(["keys", "list"], home).stdout.splitlines()}
    assert "groups=lab " in rows[full.split("_")[1]] + " "
    assert "groups=lab  scope=lab" in rows[scoped.split("_")[1]]
    widen = _run(["keys", "create", "--user", "lena", "--group", "finance"], home)
    assert widen.returncode == 2 and "registered with groups lab" in widen.stderr
    outside = _run(["keys", "create", "--user", "lena", "--scope", "team"], home)
    assert outside.returncode == 2 and "only narrow" in outside.stderr


def test_help_explains_commands(home):
    r = _run(["--help"], home)
    assert r.returncode == 0
    for cmd in ["ingest", "query", "serve", "keys", "users", "collections"]:
        assert cmd in r.stdout


@pytest.mark.parametrize("args, valid", [
    (["query", "hi", "--as", "otto", "--mode", "fuzzy"], "hybrid"),
    (["query", "hi", "--as", "otto", "--store", "elastic"], "faiss-hnsw"),
    (["ingest", ".", "--store", "elastic"], "pgvector"),
    (["index", "merge", "--store", "elastic"], "faiss-ivf"),
])
def test_a_bad_choice_is_a_usage_error_naming_the_valid_ones(home, args, valid):
    # click checks choices while parsing, before the command runs (so before any model loads).
    r = _run(args, home)
    assert r.returncode == 2 and "Invalid value" in r.stderr and valid in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_version_and_json_listings(home):
    v = _run(["--version"], home)
    assert v.returncode == 0 and v.stdout.startswith("labrag ")
    _run(["users", "add", "jude", "--group", "team"], home)
    key = _run(["keys", "create", "--user", "jude", "--scope", "team"], home).stdout.strip()
    users = json.loads(_run(["users", "list", "--json"], home).stdout)
    assert {"user": "jude", "groups": ["team"]} in users
    keys = {k["id"]: k for k in json.loads(_run(["keys", "list", "--json"], home).stdout)}
    mine = keys[key.split("_")[1]]
    assert mine["user"] == "jude" and mine["groups"] == ["team"] and mine["scope"] == ["team"] and not mine["revoked"]
    assert key not in json.dumps(keys)
    collections = json.loads(_run(["collections", "--json"], home).stdout)
    assert isinstance(collections, list) and all({"name", "documents", "chunks"} <= set(c) for c in collections)
