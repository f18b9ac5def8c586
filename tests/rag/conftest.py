"""Fixtures for end-to-end tests: a Rag over a temporary data directory with real models.

Models are converted once per test session into a shared cache (RAG model caches are
plain folders), so each test's data directory links to it instead of converting again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rag.pipeline import Rag
from rag.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
LAB_DOCS = REPO / "examples" / "lab-docs"

DEMO_USERS = {"alice": ["genomics"], "bob": ["imaging"], "carol": ["hpc-admins"], "dave": []}


def make_rag(home: Path, model_cache: Path, **overrides) -> Rag:
    home.mkdir(parents=True, exist_ok=True)
    link = home / "models"
    if not link.exists():
        link.symlink_to(model_cache, target_is_directory=True)
    return Rag(load_settings(home=home, **overrides))


@pytest.fixture(scope="session")
def rag_factory(model_cache):
    """make_rag(home, **setting overrides) sharing the session's model cache."""
    return lambda home, **overrides: make_rag(home, model_cache, **overrides)


@pytest.fixture(scope="session")
def lab_copy(tmp_path_factory) -> Path:
    """A private copy of the sample corpus (tests may not touch the repo's files)."""
    dest = tmp_path_factory.mktemp("corpus") / "lab-docs"
    shutil.copytree(LAB_DOCS, dest)
    return dest


@pytest.fixture(scope="session")
def lab_rag(tmp_path_factory, model_cache, lab_copy) -> Rag:
    """The sample corpus ingested once, with the demo users registered."""
    rag = make_rag(tmp_path_factory.mktemp("home"), model_cache, max_new_tokens=40)
    report = rag.ingest([lab_copy])
    assert report.ok, report.problems
    for user, groups in DEMO_USERS.items():
        rag.identity.add_user(user, groups)
    return rag


@pytest.fixture
def replicas(pg_dsn):
    """Two identity stores over one PostgreSQL: two replicas' processes (store = pgvector)."""
    from rag.pg_identity import PgIdentityStore

    a, b = PgIdentityStore(pg_dsn), PgIdentityStore(pg_dsn)
    yield a, b
    a.close()
    b.close()
