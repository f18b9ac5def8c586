"""Test-wide settings: offline models, no analytics pings, quiet tokenizers."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

try:
    import psycopg  # noqa: F401

    pytest_plugins = ["tests.ci_gate", "tests.file_order", "tests.pg_fixture"]
except ImportError:  # the GPU machine has no psycopg; its `gpu` tests need no database
    pytest_plugins = ["tests.ci_gate", "tests.file_order"]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Property-based tests (the fuzz suites): "default" keeps CI quick; HYPOTHESIS_PROFILE=slow
# runs 10,000+ examples in all for a hardening session. No deadline: real models and real
# servers make single examples slow without anything being wrong.
try:
    from hypothesis import settings as _hypothesis_settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    # Failing examples are replayed first on the next run; kept under an ignored directory.
    _failures = DirectoryBasedExampleDatabase(Path(__file__).resolve().parents[1] / ".pytest_cache" / "hypothesis")
    _hypothesis_settings.register_profile("default", max_examples=25, deadline=None, database=_failures)
    _hypothesis_settings.register_profile("slow", max_examples=1000, deadline=None, stateful_step_count=30,
                                          database=_failures)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
except ImportError:  # the GPU machine runs only `gpu` tests and may lack hypothesis
    pass


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One converted-model cache for the whole session (reranker, generator)."""
    return tmp_path_factory.mktemp("model-cache")


def pytest_configure(config) -> None:
    """The session's forward memo (rag.forward_memo): one folder for this run's processes.

    The end-to-end tests embed and rerank the same sample corpus and questions dozens of times,
    through the API, the CLI and servers in subprocesses (which inherit the variable); each exact
    forward pass is computed once per run. `RAG_TEST_FORWARD_MEMO=` (set, empty) turns it off.
    xdist workers inherit the controller's folder; the process that made it removes it.
    """
    from rag.forward_memo import ENV

    if ENV not in os.environ:
        os.environ[ENV] = tempfile.mkdtemp(prefix="rag-forward-memo-")
        config._rag_forward_memo = os.environ[ENV]


def pytest_unconfigure(config) -> None:
    folder = getattr(config, "_rag_forward_memo", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def without_forward_memo(monkeypatch):
    """Every forward pass computed: for the tests of the models themselves (numerics, batching, workers)."""
    from rag.forward_memo import ENV

    monkeypatch.delenv(ENV, raising=False)
