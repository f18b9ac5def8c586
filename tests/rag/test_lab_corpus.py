"""End to end over the sample corpus: same question, different users, different sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from permissions.models import Principal

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow

QUESTIONS = Path(__file__).resolve().parents[2] / "examples" / "questions.jsonl"


def _relkey(hit_key: str, root: Path) -> str:
    path, _, record = hit_key.partition("#")
    rel = str(Path(path).relative_to(root))
    return f"{rel}#{record}" if record else rel


def _ask(rag, question, user, k=5):
    return rag.query(question, rag.principal(user), k=k, generate=False)


def test_two_users_same_question_different_sources(lab_rag, lab_copy):
    q = "Which GPU nodes can I use?"
    bob = _ask(lab_rag, q, "bob")
    dave = _ask(lab_rag, q, "dave")
    bob_docs = {_relkey(h.document_key, lab_copy) for h in bob.hits}
    dave_docs = {_relkey(h.document_key, lab_copy) for h in dave.hits}
    assert "imaging/gpu-reservation.txt" in bob_docs
    assert all(d.startswith("public/") for d in dave_docs), dave_docs
    assert any("cryoem-res" in h.text for h in bob.hits)
    assert not any("cryoem-res" in h.text for h in dave.hits)


def test_labelled_questions_respect_acls_and_find_relevant(lab_rag, lab_copy):
    """Every labelled question: no forbidden source ever; recall@5 over the answerable ones."""
    found = answerable = 0
    for line in QUESTIONS.read_text().splitlines():
        q = json.loads(line)
        principal = Principal(q["user"], frozenset(q["groups"]))
        answer = lab_rag.query(q["question"], principal, k=5, generate=False)
        keys = [_relkey(h.document_key, lab_copy) for h in answer.hits]
        assert not set(keys) & set(q.get("forbidden", [])), (q["question"], q["user"], keys)
        for h in answer.hits:
            assert principal.can_read(h.acl)
        if q["relevant"]:
            answerable += 1
            found += bool(set(keys) & set(q["relevant"]))
    # The labelled set has ~29 answerable questions; dense + rerank finds nearly all.
    assert answerable >= 20
    assert found / answerable >= 0.8, f"recall@5 {found}/{answerable}"


def test_planted_secrets_stay_in_their_groups(lab_rag):
    """A user never sees another group's distinctive strings, whatever they ask for."""
    probes = {"INC-2291": "carol", "cryoem-res": "bob", "FRZ-80-B": "alice", "EMB-7731": "alice"}
    for secret, owner in probes.items():
        for user in ["alice", "bob", "carol", "dave"]:
            answer = _ask(lab_rag, f"What is {secret}?", user, k=10)
            seen = any(secret in h.text for h in answer.hits)
            assert seen == (user == owner), (secret, user)  # hidden from the others, found by its owner


def test_generated_answer_cites_only_readable_sources(lab_rag):
    answer = lab_rag.query("What temperature is the -80 freezer alarm set to?",
                           lab_rag.principal("alice"), k=3)
    assert answer.text
    assert answer.citations and all(
        lab_rag.principal("alice").can_read(h.acl) for h in answer.hits)
    bob = lab_rag.query("What temperature is the -80 freezer alarm set to?",
                        lab_rag.principal("bob"), k=3)
    assert bob.text is not None
    for secret in ["FRZ-80-B", "B214"]:
        assert secret not in bob.text
        assert all(secret not in c.text for c in bob.citations)


def test_nothing_relevant_gives_a_fixed_answer_without_generating(lab_rag):
    answer = lab_rag.query("What temperature is the -80 freezer alarm set to?",
                           lab_rag.principal("dave"), k=3)
    assert answer.text.startswith("I don't know")
    assert answer.citations == [] and "generate" not in answer.timings
