"""Randomized leak test: many random ACLs, users and queries; nothing unreadable ever shows.

Each document carries a secret word unique to it. For every (user, query) pair we check
the hits and the citations, and for a sample the prompt as the generator received it (captured
at the Generator boundary) and the generated answer: none may contain a chunk, or a secret word,
of a document the user may not read.
"""

from __future__ import annotations

import json
import random

import pytest

from permissions.models import Principal

# Starts servers or runs the pipeline end to end: out of the quick loop (pytest -m 'not slow').
pytestmark = pytest.mark.slow


class PromptRecorder:
    """A Generator that records every request, then lets the real one answer it."""

    def __init__(self, inner) -> None:
        self.inner, self.requests = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def stream(self, request):
        self.requests.append(request)
        return self.inner.stream(request)

GROUPS = [f"g{i}" for i in range(6)]
USERS = [f"u{i}" for i in range(8)]
TOPICS = ["freezer", "sequencer", "microscope", "cluster", "budget", "safety", "python", "slurm"]
FILLER = ("sample protocol buffer incubate centrifuge aliquot node partition quota storage "
          "pipeline image reagent seminar meeting grant backup account login script").split()


def _random_acl(rng: random.Random) -> list[str]:
    choices = [f"group:{g}" for g in GROUPS] + [f"user:{u}" for u in USERS] + ["public"]
    weights = [4] * len(GROUPS) + [2] * len(USERS) + [1]
    n = rng.choice([0, 1, 1, 1, 2, 3])
    return sorted(set(rng.choices(choices, weights=weights, k=n)))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(n))


def _write_corpus(rng: random.Random, corpus) -> dict[str, frozenset[str]]:
    corpus.mkdir()
    (corpus / ".rag-acl.toml").write_text("allow = []\n")
    secrets: dict[str, frozenset[str]] = {}
    lines = []
    for i in range(120):
        topic = rng.choice(TOPICS)
        secret = f"secret{i:03d}x"
        acl = _random_acl(rng)
        text = (f"Notes about the {topic}. {_words(rng, 30)} The code word for this {topic} "
                f"note is {secret}. {_words(rng, 20)}")
        lines.append(json.dumps({"id": f"doc{i}", "text": text, "title": f"{topic} {i}",
                                 "acl": acl}))
        secrets[secret] = frozenset(acl)
    (corpus / "records.jsonl").write_text("\n".join(lines) + "\n")
    return secrets


@pytest.mark.parametrize("store", ["faiss", "faiss-hnsw", "pgvector"])
def test_random_acls_never_leak(tmp_path, rag_factory, request, store):
    rng = random.Random(1234)
    secrets = _write_corpus(rng, tmp_path / "corpus")
    dsn = request.getfixturevalue("pg_dsn") if store == "pgvector" else None
    # Generation, so that every prompt the generator gets is checked (extraction's own check:
    # tests/rag/test_extractive.py::test_it_never_quotes_or_scores_text_the_asker_may_not_read).
    rag = rag_factory(tmp_path / "home", max_new_tokens=24, store=store, dsn=dsn, answer_mode="generate")
    report = rag.ingest([tmp_path / "corpus"])
    assert report.ok, report.problems
    assert report.added == 120
    recorder, captured = None, 0
    if store == "faiss":
        recorder = PromptRecorder(rag.generator)
        rag.__dict__["generator"] = recorder  # what the pipeline will call

    for trial in range(60):
        principal = Principal(rng.choice(USERS), frozenset(rng.sample(GROUPS, rng.randint(0, 3))))
        question = f"What is the code word for the {rng.choice(TOPICS)} note?"
        k = rng.choice([1, 3, 5, 10, 50])
        # A few real generations and reranks (slow on CPU); every trial checks retrieval,
        # whose post-check runs before the reranker ever sees a hit.
        generate = trial % 20 == 0 and store == "faiss"
        # every retrieval leg: the dense search, the keyword search and their fusion
        mode = ("hybrid", "dense", "keyword")[trial % 3]
        answer = rag.query(question, principal, k=k, generate=generate, rerank=trial % 6 == 0, mode=mode)
        readable = {s for s, acl in secrets.items() if principal.can_read(acl)}
        # The filter runs inside the search: when k exceeds what is readable, every
        # readable document comes back, and nothing else does.
        assert len(answer.hits) == min(k, len(readable)), trial
        for hit in answer.hits:
            assert principal.can_read(hit.acl)
            found = {s for s in secrets if s in hit.text}
            assert found and found <= readable
        prompt = []
        if generate and answer.citations:
            assert recorder.requests, "the generator was not called"
            prompt = recorder.requests.pop().messages
            captured += 1
            assert all(c.text.strip() in prompt[-1]["content"] for c in answer.citations)
        shown = json.dumps([prompt, [h.text for h in answer.hits], [c.text for c in answer.citations],
                            [c.source for c in answer.citations], answer.text])
        for secret in set(secrets) - readable:
            assert secret not in shown, (trial, secret)
        if generate:
            assert answer.text is not None
    if recorder is not None:
        assert captured >= 2  # prompts really went through the generator boundary


def test_a_chunk_of_one_collection_is_not_found_in_another(tmp_path, rag_factory):
    """GET /v1/documents/A/{id} must not show a chunk of collection B under A's name (ids are catalog-wide)."""
    for name in ("lab", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "note.md").write_text(f"# {name}\n\nThe {name} freezer is in room 4{len(name)}.\n")
        (tmp_path / name / ".rag-acl.toml").write_text('allow = ["*"]\n')
    rag = rag_factory(tmp_path / "home")
    try:
        assert rag.ingest([tmp_path / "lab"], collection="lab").ok
        assert rag.ingest([tmp_path / "other"], collection="other").ok
        anyone = Principal("u0", frozenset())
        (hit,) = rag.query("freezer room", anyone, collection="other", k=1, generate=False).hits
        assert rag.readable_chunk("other", hit.chunk_id, anyone) is not None
        assert rag.readable_chunk("lab", hit.chunk_id, anyone) is None
    finally:
        rag.close()
