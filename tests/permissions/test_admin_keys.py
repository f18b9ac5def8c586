"""Admin keys (`rag keys create --admin`): which keys are admins, older key databases, the CLI."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys

import pytest

from permissions.identity import IdentityStore
from rag.errors import ConfigError


def _key_id(key: str) -> str:
    return key.split("_")[1]


def test_only_keys_made_admin_are_admins(ids):
    admin = ids.create_key("carol", ["hpc-admins"], admin=True)
    user = ids.create_key("alice", ["genomics"])
    assert ids.is_admin(_key_id(admin)) and not ids.is_admin(_key_id(user))
    assert not ids.is_admin("no-such-key")
    assert ids.admin_key_ids() == {_key_id(admin)}
    assert ids.authenticate(admin).user == "carol"  # an admin key reads what its user may read, no more
    assert ids.authenticate(admin).groups == frozenset({"hpc-admins"})


def test_a_proxy_key_cannot_be_an_admin(ids):
    with pytest.raises(ConfigError, match="cannot be an admin"):
        ids.create_key(None, label="open-webui", proxy=True, admin=True)
    assert ids.list_keys() == []


def test_an_older_key_database_gains_the_column_and_no_admins(tmp_path):
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)  # before admin keys: no admin column
    old.executescript("""
        CREATE TABLE users (name TEXT PRIMARY KEY, groups TEXT NOT NULL, created_at REAL NOT NULL);
        CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, key_hash TEXT NOT NULL, user TEXT NOT NULL,
            groups TEXT NOT NULL, label TEXT, created_at REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
            kind TEXT NOT NULL DEFAULT 'user', scope TEXT);
    """)
    key = "rag_abc123_secret"
    old.execute("INSERT INTO users VALUES ('bob', '[\"imaging\"]', 0)")
    old.execute("INSERT INTO api_keys VALUES ('abc123', ?, 'bob', '[\"imaging\"]', NULL, 0, 0, 'user', NULL)",
                (hashlib.sha256(key.encode()).hexdigest(),))
    old.commit()
    old.close()
    ids = IdentityStore(path)
    try:
        assert ids.authenticate(key).user == "bob" and not ids.is_admin("abc123")
        columns = {r[1] for r in ids.conn.execute("PRAGMA table_info(api_keys)")}
        assert "admin" in columns
        assert ids.is_admin(_key_id(ids.create_key("carol", admin=True)))
    finally:
        ids.close()
    IdentityStore(path).close()  # a second open finds the column there


@pytest.mark.slow
def test_cli_creates_and_lists_admin_keys(tmp_path):
    env = {**os.environ, "RAG_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}

    def rag(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rag.cli", *args], env=env, capture_output=True, text=True,
                              timeout=300)

    assert "--admin" in rag("keys", "create", "--help").stdout
    admin = rag("keys", "create", "--user", "carol", "--group", "hpc-admins", "--admin")
    user = rag("keys", "create", "--user", "alice", "--group", "genomics")
    assert admin.returncode == user.returncode == 0, admin.stderr + user.stderr
    listing = {line.split()[0]: line for line in rag("keys", "list").stdout.splitlines()}
    assert " admin" in listing[_key_id(admin.stdout.strip())]
    assert " admin" not in listing[_key_id(user.stdout.strip())]
    refused = rag("keys", "create", "--proxy", "--label", "open-webui", "--admin")
    assert refused.returncode != 0 and "cannot be an admin" in refused.stdout + refused.stderr
