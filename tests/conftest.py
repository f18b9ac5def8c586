"""Test-wide settings: offline models, no analytics pings, quiet tokenizers."""

import os
from pathlib import Path

import pytest

try:
    import psycopg  # noqa: F401

    pytest_plugins = ["tests.pg_fixture"]
except ImportError:  # the GPU machine has no psycopg; its `gpu` tests need no database
    pytest_plugins = []
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One converted-model cache for the whole session (reranker, generator)."""
    return tmp_path_factory.mktemp("model-cache")
