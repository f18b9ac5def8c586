"""Question-set readers: the project's JSONL (both label styles) and BEIR folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag.errors import ConfigError
from rag.experiments import read_beir, read_jsonl, read_questions, write_records

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_reads_the_sample_set_and_the_documentation_set():
    sample = read_jsonl(EXAMPLES / "questions.jsonl").questions
    first = sample[0]
    assert (first.text, first.user, first.groups) == ("Which GPU nodes can I use?", "dave", ())
    assert first.sources == ("public/cluster-user-guide.md", "public/slurm-partitions.html")
    assert first.expected == "gpu01-gpu08"  # the older `expect_contains`
    assert "hpc-admins/node-inventory.txt" in first.forbidden
    pg = read_questions(EXAMPLES / "eval" / "postgresql" / "questions.jsonl").questions
    assert len(pg) >= 40
    # `sources` names every answer page, readable or not: the stored ACLs decide later
    mixed = [q for q in pg if set(q.forbidden) & set(q.sources)]
    assert mixed, "the documentation set has questions with answer pages the asker may not read"
    assert all(q.expected for q in pg)


def test_bad_lines_are_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "ok?", "user": "dave"}\n{"question": "who?"}\n')
    with pytest.raises(ConfigError, match="line 2: 'user'"):
        read_jsonl(path)
    path.write_text("{nope\n")
    with pytest.raises(ConfigError, match="line 1: invalid JSON"):
        read_jsonl(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_questions(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="not a BEIR set"):
        read_questions(tmp_path)


def make_beir(folder: Path) -> Path:
    (folder / "qrels").mkdir(parents=True)
    docs = [{"_id": "d1", "title": "Freezers", "text": "The -80 alarm is set to -65 C."},
            {"_id": "d2", "title": "Quotas", "text": "Home directories get 50 GB."},
            {"_id": "d3", "title": "Only a title", "text": ""},
            {"_id": "d4", "title": "", "text": ""}]
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    queries = [{"_id": "q1", "text": "freezer alarm temperature"}, {"_id": "q2", "text": "home quota"},
               {"_id": "q3", "text": "no relevant documents"}]
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t2\nq1\td3\t1\nq2\td2\t1\n"
                                               "q3\td1\t0\n")
    return folder


def test_beir_folder(tmp_path):
    folder = make_beir(tmp_path / "tiny-beir")
    qset = read_questions(folder)
    assert qset.corpus == folder and qset.name == "tiny-beir"
    by_id = {q.id: q for q in qset.questions}
    assert set(by_id) == {"q1", "q2"}  # q3 has only a zero grade
    assert by_id["q1"].sources == ("corpus.jsonl#d1", "corpus.jsonl#d3")
    assert by_id["q1"].grade("corpus.jsonl#d1") == 2 and by_id["q1"].grade("corpus.jsonl#d3") == 1
    records = write_records(folder, tmp_path / "out")
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["d1", "d2", "d3"]  # d4 has no text and no title
    assert rows[2]["text"] == "Only a title" and all(r["acl"] == ["public"] for r in rows)
    mtime = records.stat().st_mtime_ns
    write_records(folder, tmp_path / "out")
    assert records.stat().st_mtime_ns == mtime  # unchanged: not rewritten
    with pytest.raises(ConfigError, match="splits here: test"):
        read_beir(folder, split="dev")
