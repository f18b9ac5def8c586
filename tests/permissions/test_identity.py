"""API keys and the user directory, on every identity backend (tests/permissions/conftest.py)."""

from __future__ import annotations

import hashlib
import hmac
import re
import sqlite3

import pytest

from permissions.identity import IdentityStore
from permissions.models import Principal, make_acl
from rag.errors import AuthenticationError, ConfigError, NotFoundError


def test_key_maps_to_user_and_groups(ids):
    key = ids.create_key("alice", ["genomics", "shared"])
    assert ids.authenticate(key) == Principal("alice", frozenset({"genomics", "shared"}))


def test_keys_are_stored_hashed(ids, raw):
    key = ids.create_key("alice", ["genomics"])
    rows = raw.key_rows()
    assert len(rows) == 1 and key not in repr(rows)
    # The secret is everything after "rag_<id>_"; token_urlsafe may itself contain "_".
    secret = key.split("_", 2)[2]
    assert secret not in repr(rows)


def test_the_stored_hash_is_the_sha256_of_the_whole_key(ids, raw):
    keys = [ids.create_key("alice", ["genomics"]), ids.create_key(None, label="open-webui", proxy=True)]
    assert raw.hashes() == {key.split("_")[1]: hashlib.sha256(key.encode()).hexdigest() for key in keys}


class _NoEq(str):
    """A digest that fails the test if it is ever compared with == or != (a comparison that stops early)."""

    def __eq__(self, other):
        raise AssertionError("a key digest was compared with ==, not hmac.compare_digest")

    __ne__ = __eq__
    __hash__ = str.__hash__


@pytest.mark.parametrize("case", ["valid", "wrong secret", "unknown id", "revoked", "missing", "empty",
                                  "no prefix", "prefix only", "no secret part", "a bearer header"])
def test_every_key_is_checked_by_one_constant_time_digest_comparison(ids, monkeypatch, case):
    import permissions.identity as identity

    key = ids.create_key("alice")
    if case == "revoked":
        ids.revoke_key(key.split("_")[1])
    presented = {"valid": key, "wrong secret": key[:-1] + ("A" if key[-1] != "A" else "B"),
                 "unknown id": "rag_0123456789ab_" + key.split("_", 2)[2], "revoked": key, "missing": None,
                 "empty": "", "no prefix": "nope", "prefix only": "rag_", "no secret part": "rag_abc",
                 "a bearer header": f"Bearer {key}"}[case]
    compared, real_compare = [], hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(identity, "_hash", lambda k: _NoEq(hashlib.sha256(k.encode()).hexdigest()))
    monkeypatch.setattr(identity.hmac, "compare_digest", compare_digest)
    if case == "valid":
        assert ids.authenticate(presented).user == "alice"
    else:
        with pytest.raises(AuthenticationError, match="invalid or missing API key"):
            ids.authenticate(presented)
    # One comparison whatever went wrong, of two SHA-256 digests (equal lengths: its time says
    # nothing about the stored hash), the first that of the key presented.
    assert len(compared) == 1
    (mine, other), = compared
    assert str(mine) == hashlib.sha256((presented or "").encode()).hexdigest()
    assert re.fullmatch("[0-9a-f]{64}", str(other))


@pytest.mark.parametrize("bad", [None, "", "nope", "rag_", "rag_abc_def", "Bearer x"])
def test_bad_keys_are_rejected_with_one_message(ids, bad):
    ids.create_key("alice")
    with pytest.raises(AuthenticationError, match="invalid or missing API key"):
        ids.authenticate(bad)


def test_tampered_and_revoked_keys(ids):
    key = ids.create_key("alice")
    with pytest.raises(AuthenticationError):
        ids.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B"))
    key_id = ids.list_keys()[0].key_id
    ids.revoke_key(key_id)
    with pytest.raises(AuthenticationError):
        ids.authenticate(key)
    with pytest.raises(NotFoundError):
        ids.revoke_key("missing")


def test_user_directory(ids):
    ids.add_user("bob", ["imaging"])
    assert ids.principal_for("bob", ["extra"]).groups == {"imaging", "extra"}
    ids.add_user("bob", ["hpc"])
    assert ids.principal_for("bob").groups == {"hpc"}
    with pytest.raises(NotFoundError, match="unknown user 'zed-nobody'"):
        ids.principal_for("zed-nobody")
    assert ids.principal_for("root").user == "root"  # system users are known


def test_system_users_get_their_posix_groups(ids):
    """An unregistered system user's groups are what `id -Gn` says (primary and supplementary)."""
    import pwd
    import shutil
    import subprocess

    if shutil.which("id") is None:
        pytest.skip("no `id` command to compare with")
    checked = 0
    for entry in pwd.getpwall()[:200]:
        out = subprocess.run(["id", "-Gn", entry.pw_name], capture_output=True, text=True)
        if out.returncode != 0 or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", entry.pw_name):
            continue
        expected = set(out.stdout.split())
        assert ids.principal_for(entry.pw_name).groups == expected, entry.pw_name
        checked += 1
    assert checked >= 1


def test_names_and_acl_entries_are_checked():
    with pytest.raises(ConfigError):
        Principal("bad name")
    with pytest.raises(ConfigError, match="invalid ACL entry"):
        make_acl(["admins"])
    assert make_acl(["*", "group:x", " user:y "]) == {"public", "group:x", "user:y"}
    p = Principal("u", frozenset({"g"}))
    assert p.can_read({"group:g"}) and p.can_read({"public"}) and not p.can_read({"group:h"})
    assert not p.can_read(set())


def test_a_registered_users_key_follows_the_directorys_groups(ids):
    ids.add_user("alice", ["genomics"])
    key = ids.create_key("alice")  # no --group: the directory says genomics
    assert ids.authenticate(key).groups == {"genomics"}
    ids.add_user("alice", [])      # removed from genomics: the key loses it at once
    assert ids.authenticate(key).groups == frozenset()
    first = ids.create_key("carl", ["x"])  # not registered yet: registers carl with x
    assert ids.registered("carl").groups == {"x"} and ids.authenticate(first).groups == {"x"}


def test_a_key_never_carries_groups_of_its_own(ids, raw):
    ids.add_user("alice", ["genomics"])
    with pytest.raises(ConfigError, match="registered with groups genomics"):
        ids.create_key("alice", ["imaging"])  # would have been a silent widening
    key = ids.create_key("alice", ["genomics"])  # the same groups: fine
    # A user missing from the directory (a hand-edited database, a key from an older version)
    # gets no groups from the key's creation record: fail closed.
    raw.delete_user("alice")
    assert ids.authenticate(key).groups == frozenset()


def test_a_scope_narrows_a_key_and_never_widens_it(ids):
    ids.add_user("alice", ["genomics", "imaging"])
    scoped = ids.create_key("alice", scope=["imaging"])
    assert ids.authenticate(scoped).groups == {"imaging"}
    ids.add_user("alice", ["genomics"])  # alice leaves imaging: the scoped key has nothing left
    assert ids.authenticate(scoped).groups == frozenset()
    ids.add_user("alice", ["genomics", "imaging", "shared"])  # joins more: the scope still holds
    assert ids.authenticate(scoped).groups == {"imaging"}
    with pytest.raises(ConfigError, match="only narrow"):
        ids.create_key("alice", scope=["finance"])
    with pytest.raises(ConfigError, match="no user, groups or scope"):
        ids.create_key(None, label="webui", proxy=True, scope=["imaging"])
    assert [k.scope for k in ids.list_keys()] == [("imaging",)]


def test_keys_made_before_scopes_existed_keep_working(tmp_path):

    path = tmp_path / "identity.db"
    old = sqlite3.connect(path)  # the schema of the previous release: no scope column
    old.executescript("""
        CREATE TABLE users (name TEXT PRIMARY KEY, groups TEXT NOT NULL, created_at REAL NOT NULL);
        CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, key_hash TEXT NOT NULL, user TEXT NOT NULL,
            groups TEXT NOT NULL, label TEXT, created_at REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
            kind TEXT NOT NULL DEFAULT 'user');
        INSERT INTO users VALUES ('bob', '["imaging"]', 0);
    """)
    import hashlib
    key = "rag_abc123_secret"
    old.execute("INSERT INTO api_keys VALUES ('abc123', ?, 'bob', '[\"imaging\"]', NULL, 0, 0, 'user')",
                (hashlib.sha256(key.encode()).hexdigest(),))
    old.commit()
    old.close()
    ids = IdentityStore(path)
    assert ids.authenticate(key).groups == {"imaging"}
    assert ids.list_keys()[0].scope is None
