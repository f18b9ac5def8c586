"""Settings: defaults, TOML file, environment precedence, clear errors."""

from __future__ import annotations

import pytest

from rag.errors import ConfigError
from rag.settings import load_settings


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("RAG_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    s = load_settings()
    assert str(s.home) == ".rag" and s.collection == "default" and s.top_k == 5


def test_file_then_env_then_overrides(monkeypatch, tmp_path):
    (tmp_path / "rag.toml").write_text('top_k = 7\ncollection = "lab"\n')
    monkeypatch.setenv("RAG_HOME", str(tmp_path))
    assert load_settings().top_k == 7
    monkeypatch.setenv("RAG_TOP_K", "9")
    s = load_settings()
    assert s.top_k == 9 and s.collection == "lab"
    assert load_settings(top_k=3).top_k == 3


def test_bad_values_are_config_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="top_k"):
        load_settings(top_k=0)
    with pytest.raises(ConfigError, match="invalid collection name"):
        load_settings(collection="../etc")
    (tmp_path / "rag.toml").write_text("top_k = [")
    with pytest.raises(ConfigError, match="cannot read settings file"):
        load_settings()
    (tmp_path / "rag.toml").write_text("no_such_field = 1")
    with pytest.raises(ConfigError, match="no_such_field"):
        load_settings()


def test_hnsw_graph_settings_are_checked_against_pgvectors_bounds(monkeypatch, tmp_path):
    monkeypatch.setenv("RAG_HOME", str(tmp_path))
    monkeypatch.setenv("RAG_PG_HNSW_M", "24")
    monkeypatch.setenv("RAG_PG_HNSW_EF_CONSTRUCTION", "100")
    s = load_settings()
    assert (s.pg_hnsw_m, s.pg_hnsw_ef_construction) == (24, 100)
    with pytest.raises(ConfigError, match="pg_hnsw_m"):
        load_settings(pg_hnsw_m=101)
    with pytest.raises(ConfigError, match="pg_hnsw_ef_construction"):
        load_settings(pg_hnsw_ef_construction=3)
    # pgvector refuses ef_construction < 2 x m at CREATE INDEX, long after the ingest started: refused here.
    with pytest.raises(ConfigError, match=r"pg_hnsw_ef_construction must be at least 2 x pg_hnsw_m = 64 .*got 63"):
        load_settings(pg_hnsw_m=32, pg_hnsw_ef_construction=63)
