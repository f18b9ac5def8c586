"""Trusted-proxy rules: which user a front end's key names, and which requests are refused."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from permissions.identity import IdentityStore
from permissions.models import Principal
from permissions.proxy import (
    DEFAULT_USER_HEADERS,
    MalformedUserHeader,
    MissingUserHeader,
    UnknownProxyUser,
    asserted_user,
    resolve_proxy_user,
)
from rag.errors import ConfigError, PermissionDenied


class Headers(dict):
    """Case-insensitive like Starlette's request headers."""

    def __init__(self, **kv):
        super().__init__({k.lower(): v for k, v in kv.items()})

    def get(self, key, default=None):
        return super().get(key.lower(), default)


DIRECTORY = {"alice": Principal("alice", frozenset({"genomics"})),
             "carol@lab.example.org": Principal("carol@lab.example.org", frozenset({"hpc-admins"}))}


def resolve(**headers):
    return resolve_proxy_user(Headers(**headers), DEFAULT_USER_HEADERS, DIRECTORY.get)


def test_the_first_present_header_wins_and_blank_counts_as_absent():
    both = Headers(**{"X-OpenWebUI-User-Email": "carol@lab.example.org", "X-Forwarded-User": "alice"})
    assert asserted_user(both, DEFAULT_USER_HEADERS) == ("X-OpenWebUI-User-Email", "carol@lab.example.org")
    blank = Headers(**{"X-OpenWebUI-User-Email": "  ", "X-Forwarded-User": "alice"})
    assert asserted_user(blank, DEFAULT_USER_HEADERS) == ("X-Forwarded-User", "alice")
    assert asserted_user(Headers(**{"x-forwarded-user": " alice "}), ["X-Forwarded-User"])[1] == "alice"


def test_groups_come_from_the_directory_never_from_headers():
    p = resolve(**{"X-Forwarded-User": "alice", "X-OpenWebUI-User-Role": "admin",
                   "X-Groups": "hpc-admins", "X-Forwarded-Groups": "imaging"})
    assert p == Principal("alice", frozenset({"genomics"}))


def test_an_email_matches_a_user_registered_by_the_full_address_only():
    assert resolve(**{"X-OpenWebUI-User-Email": "carol@lab.example.org"}).groups == {"hpc-admins"}
    # alice is registered as "alice": alice@anywhere is someone else (no local-part match).
    with pytest.raises(UnknownProxyUser):
        resolve(**{"X-OpenWebUI-User-Email": "alice@evil.example.com"})


def test_no_user_header_is_refused_with_the_header_names():
    with pytest.raises(MissingUserHeader) as err:
        resolve(**{"X-Other": "alice"})
    assert err.value.status == 403 and isinstance(err.value, PermissionDenied)
    assert "front-end key" in str(err.value) and "X-OpenWebUI-User-Email" in str(err.value)
    with pytest.raises(MissingUserHeader):
        resolve_proxy_user(Headers(**{"X-Forwarded-User": "alice"}), [], DIRECTORY.get)


def test_unknown_users_get_one_message_that_names_no_one():
    messages = set()
    for name in ("mallory", "bob", "root"):
        with pytest.raises(UnknownProxyUser) as err:
            resolve(**{"X-Forwarded-User": name})
        assert err.value.status == 403 and name not in str(err.value)
        messages.add(str(err.value))
    assert len(messages) == 1 and "alice" not in messages.pop()


@pytest.mark.parametrize("value", ["a" * 257, "ali\tce", "ali\x00ce", "alice\x7f", "Alice Smith", "-alice",
                                   "alicé\u200b", "alice;groups=admin", "../alice"])
def test_malformed_or_oversized_values_are_400(value):
    with pytest.raises(MalformedUserHeader) as err:
        resolve(**{"X-Forwarded-User": value})
    assert err.value.status == 400 and value not in str(err.value)


def test_256_characters_is_still_a_name():
    name = "a" * 256
    directory = {name: Principal(name)}
    assert resolve_proxy_user(Headers(**{"X-Forwarded-User": name}), DEFAULT_USER_HEADERS,
                              directory.get).user == name


def test_proxy_keys_stand_for_no_user(ids):
    key = ids.create_key(None, label="open-webui", proxy=True)
    auth = ids.authenticate_key(key)
    assert auth.is_proxy and auth.principal is None and key.startswith(f"rag_{auth.key_id}_")
    with pytest.raises(PermissionDenied, match="front-end key"):
        ids.authenticate(key)  # the old entry point never turns a proxy key into a principal
    (info,) = ids.list_keys()
    assert info.is_proxy and info.label == "open-webui" and info.groups == ()
    assert ids.users() == []  # a proxy key registers no user
    user_key = ids.create_key("bob", ["imaging"])
    assert not ids.authenticate_key(user_key).is_proxy
    assert ids.authenticate_key(user_key).principal == Principal("bob", frozenset({"imaging"}))


def test_proxy_keys_take_no_user_or_groups_and_need_a_label(ids):
    with pytest.raises(ConfigError):
        ids.create_key("alice", label="x", proxy=True)
    with pytest.raises(ConfigError):
        ids.create_key(None, ["admins"], label="x", proxy=True)
    with pytest.raises(ConfigError, match="--label"):
        ids.create_key(None, proxy=True)
    with pytest.raises(ConfigError, match="--user"):
        ids.create_key(None)


def test_registered_knows_the_directory_only(ids):
    ids.add_user("alice", ["genomics"])
    assert ids.registered("alice") == Principal("alice", frozenset({"genomics"}))
    assert ids.registered("root") is None  # a system user is not registered


def test_keys_of_an_old_catalog_stay_user_keys(tmp_path):
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, key_hash TEXT NOT NULL, user TEXT NOT NULL,"
                " groups TEXT NOT NULL, label TEXT, created_at REAL NOT NULL, revoked INTEGER NOT NULL DEFAULT 0)")
    key = "rag_0123456789ab_" + "s" * 43
    old.execute("INSERT INTO api_keys VALUES ('0123456789ab', ?, 'bob', '[\"imaging\"]', NULL, 0, 0)",
                (hashlib.sha256(key.encode()).hexdigest(),))
    old.commit()
    old.close()
    migrated = IdentityStore(path)
    auth = migrated.authenticate_key(key)
    assert not auth.is_proxy and auth.principal == Principal("bob", frozenset({"imaging"}))
    assert migrated.list_keys()[0].kind == "user"
    migrated.close()
    again = IdentityStore(path)  # migrating twice is harmless
    assert again.authenticate(key).user == "bob"
    again.close()
