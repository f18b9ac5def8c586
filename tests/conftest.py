"""Test-wide settings: offline models, no analytics pings, quiet tokenizers."""

import os
from pathlib import Path

import pytest

try:
    import psycopg  # noqa: F401

    pytest_plugins = ["tests.ci_gate", "tests.pg_fixture"]
except ImportError:  # the GPU machine has no psycopg; its `gpu` tests need no database
    pytest_plugins = ["tests.ci_gate"]
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
