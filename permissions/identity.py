"""Identity: API keys and the user directory (user → groups); the rules, and their SQLite storage.

Keys look like `rag_<id>_<secret>`. Only a SHA-256 of the whole key is stored (keys are
random 256-bit secrets, so a fast hash is enough); lookup is by the public id part and
the hash is compared in constant time, so timing says nothing about other keys.

A key is of one of two kinds: a user key stands for its user and groups; a proxy key stands
for a front end (Open WebUI, LibreChat, LiteLLM) that names its end user in a request header,
whose groups then come from the user directory (see permissions/proxy.py).

`KeyDirectory` holds every rule (key format, the one constant-time comparison, scopes, proxy
and admin keys) over a handful of storage primitives; `IdentityStore` stores them in the data
directory's SQLite (the embedded default), rag/pg_identity.py in PostgreSQL (store = pgvector,
shared by every replica). `Identity` is the protocol both satisfy.
"""

from __future__ import annotations

import grp
import hashlib
import hmac
import json
import pwd
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from permissions.models import Principal, check_name
from rag.errors import AuthenticationError, ConfigError, NotFoundError, PermissionDenied
from rag.private_files import create_private_sqlite_file, private_mkdir
from rag.sqlite_threads import ThreadConnections

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY,
    groups TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL,
    user TEXT NOT NULL,
    groups TEXT NOT NULL,
    label TEXT,
    created_at REAL NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0,
    kind TEXT NOT NULL DEFAULT 'user',
    scope TEXT,
    admin INTEGER NOT NULL DEFAULT 0
);
"""

USER_KEY, PROXY_KEY = "user", "proxy"

_KEY_PREFIX = "rag_"


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    user: str
    groups: tuple[str, ...]
    label: str | None
    created_at: float
    revoked: bool
    kind: str = USER_KEY
    scope: tuple[str, ...] | None = None  # a user key restricted to these of its user's groups

    @property
    def is_proxy(self) -> bool:
        return self.kind == PROXY_KEY


@dataclass(frozen=True)
class KeyRecord:
    """A stored key as a whole, its hash included: what `rag users migrate` copies between backends."""

    info: KeyInfo
    key_hash: str
    admin: bool


@dataclass(frozen=True)
class KeyRow:
    """What authenticating a key reads of it."""

    key_hash: str
    user: str
    revoked: bool
    kind: str
    scope: tuple[str, ...] | None
    admin: bool


@dataclass(frozen=True)
class AuthenticatedKey:
    """A valid key: its id, its kind, and for a user key the principal it stands for.

    A proxy key's `principal` is None: the user comes from the request (permissions/proxy.py).
    """

    key_id: str
    kind: str
    principal: Principal | None

    @property
    def is_proxy(self) -> bool:
        return self.kind == PROXY_KEY


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@runtime_checkable
class Identity(Protocol):
    """Users, their groups and API keys, wherever they are stored (SQLite or PostgreSQL)."""

    def add_user(self, name: str, groups: list[str] | tuple[str, ...] = ()) -> Principal: ...
    def users(self) -> list[Principal]: ...
    def registered(self, user: str) -> Principal | None: ...
    def principal_for(self, user: str, extra_groups: list[str] | tuple[str, ...] = ()) -> Principal: ...
    def create_key(self, user: str | None, groups: list[str] | tuple[str, ...] = (), label: str | None = None,
                   proxy: bool = False, scope: list[str] | tuple[str, ...] | None = None,
                   admin: bool = False) -> str: ...
    def authenticate(self, key: str | None) -> Principal: ...
    def authenticate_key(self, key: str | None) -> AuthenticatedKey: ...
    def key_groups(self, user: str, scope: list[str] | tuple[str, ...] | None) -> frozenset[str]: ...
    def list_keys(self) -> list[KeyInfo]: ...
    def revoke_key(self, key_id: str) -> None: ...
    def is_admin(self, key_id: str) -> bool: ...
    def admin_key_ids(self) -> set[str]: ...
    def key_records(self) -> list[KeyRecord]: ...
    def close(self) -> None: ...


class KeyDirectory:
    """The rules of users and keys, over storage primitives that a subclass implements.

    Primitives (each one statement): `_put_user`, `_user_rows`, `_user_groups`, `_insert_key`,
    `_key_row`, `_key_records`, `_revoke`. `_begin_lookup` runs first in every authentication
    (a backend with a cache checks it there). `_db_errors` are the storage's own errors, on
    which `is_admin` fails closed.
    """

    _db_errors: tuple[type[Exception], ...] = ()

    # -- storage primitives --------------------------------------------------------------

    def _put_user(self, name: str, groups: list[str]) -> None:
        raise NotImplementedError

    def _user_rows(self) -> list[tuple[str, list[str]]]:
        raise NotImplementedError

    def _user_groups(self, name: str) -> list[str] | None:
        raise NotImplementedError

    def _insert_key(self, record: KeyRecord) -> None:
        raise NotImplementedError

    def _key_row(self, key_id: str) -> KeyRow | None:
        raise NotImplementedError

    def _key_records(self) -> list[KeyRecord]:
        raise NotImplementedError

    def _revoke(self, key_id: str) -> bool:
        raise NotImplementedError

    def _begin_lookup(self) -> None:
        """Called once at the start of each authentication (a request's first identity read)."""

    def close(self) -> None:
        raise NotImplementedError

    # -- users -------------------------------------------------------------------------

    def add_user(self, name: str, groups: list[str] | tuple[str, ...] = ()) -> Principal:
        """Register a user (or replace their groups)."""
        principal = Principal(check_name(name, "user"), frozenset(groups))
        self._put_user(name, sorted(principal.groups))
        return principal

    def users(self) -> list[Principal]:
        return [Principal(name, frozenset(groups)) for name, groups in self._user_rows()]

    def registered(self, user: str) -> Principal | None:
        """A user of the directory (never a system user), or None if not registered."""
        groups = self._user_groups(user)
        return None if groups is None else Principal(user, frozenset(groups))

    def principal_for(self, user: str, extra_groups: list[str] | tuple[str, ...] = ()) -> Principal:
        """Resolve a user name to a principal: the directory first, then the system's.

        Raises:
            NotFoundError: the user is neither registered nor a system user.
        """
        check_name(user, "user")
        stored = self._user_groups(user)
        if stored is not None:
            groups = set(stored)
        else:
            system = system_groups(user)
            if system is None:
                raise NotFoundError(
                    f"unknown user {user!r}: register it with `rag users add {user} --group G`"
                    " (or create a key with `rag keys create --user ...`)"
                )
            groups = system
        return Principal(user, frozenset(groups | set(extra_groups)))

    # -- keys --------------------------------------------------------------------------

    def create_key(self, user: str | None, groups: list[str] | tuple[str, ...] = (),
                   label: str | None = None, proxy: bool = False,
                   scope: list[str] | tuple[str, ...] | None = None, admin: bool = False) -> str:
        """Create a key; returns the key (shown once).

        A user key identifies its user: its groups come from the user directory at request
        time. `groups` only registers a user who is not in the directory yet; `scope` narrows a
        key to some of its user's groups (it can never widen them).

        Args:
            user: the user a user key stands for (None for a proxy key).
            groups: groups to register a new user with (a registered user keeps theirs; a proxy
                key takes none: they come from the directory).
            label: a note to tell keys apart (required for a proxy key: it names the front end).
            proxy: make a proxy key, for a front end that names its user in a header.
            scope: restrict the key to these groups of its user (None: all of them).
            admin: an operator's key: its API answers carry stage timings (see `is_admin`).

        Raises:
            ConfigError: a user, groups or scope for a proxy key, no label for one, no user for a
            user key, groups that differ from a registered user's, or a scope outside them.
        """
        key_id = secrets.token_hex(6)
        key = f"{_KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        if proxy:
            if user or groups or scope is not None:
                raise ConfigError("a proxy key stands for a front end, not a user: give it no user, "
                                  "groups or scope (they come from the request's user header and the directory)")
            if not label:
                raise ConfigError("a proxy key needs --label naming its front end, e.g. --label open-webui")
            if admin:
                raise ConfigError("a proxy key cannot be an admin key: every user of its front end would be one")
            info = KeyInfo(key_id, "", (), label, time.time(), False, PROXY_KEY, None)
            self._insert_key(KeyRecord(info, _hash(key), admin=False))
            return key
        if not user:
            raise ConfigError("a user key needs --user NAME (or make a front-end key with --proxy)")
        check_name(user, "user")
        registered = self.registered(user)
        if registered is None:
            # The user directory learns about key holders, so `rag query --as` knows them too.
            registered = self.add_user(user, sorted(set(groups)))
        elif groups and set(groups) != registered.groups:
            raise ConfigError(
                f"{user} is registered with groups {_listing(registered.groups)}, and a key takes its "
                f"groups from there: change them with `rag users add {user} -g ...`, or narrow this key "
                "with --scope GROUP")
        scoped = None if scope is None else tuple(sorted(set(scope)))
        if scoped is not None and not set(scoped) <= registered.groups:
            outside = sorted(set(scoped) - registered.groups)
            raise ConfigError(f"a scope can only narrow a key: {user} is not in {_listing(outside)}")
        info = KeyInfo(key_id, user, tuple(sorted(registered.groups)), label, time.time(), False, USER_KEY, scoped)
        self._insert_key(KeyRecord(info, _hash(key), admin=admin))
        return key

    def authenticate(self, key: str | None) -> Principal:
        """The principal a user key stands for.

        Raises:
            AuthenticationError: missing, malformed, unknown or revoked key (one message
            for all, so a caller learns nothing about which keys exist).
            PermissionDenied: a proxy key (it stands for no user; see `authenticate_key`).
        """
        auth = self.authenticate_key(key)
        if auth.principal is None:
            raise PermissionDenied("this key is a front-end key: it must name the user in a header")
        return auth.principal

    def authenticate_key(self, key: str | None) -> AuthenticatedKey:
        """The id, kind and (for a user key) principal of a key.

        Raises:
            AuthenticationError: missing, malformed, unknown or revoked key (one message
            for all, so a caller learns nothing about which keys exist).
        """
        failure = AuthenticationError("invalid or missing API key")
        if not key or not key.startswith(_KEY_PREFIX) or key.count("_") < 2:
            # Hash anyway so a malformed key costs the same time as a wrong one.
            hmac.compare_digest(_hash(key or ""), _hash("x"))
            raise failure
        self._begin_lookup()
        key_id = key[len(_KEY_PREFIX):].split("_", 1)[0]
        row = self._key_row(key_id)
        stored = row.key_hash if row else _hash("x")
        if not hmac.compare_digest(_hash(key), stored) or row is None or row.revoked:
            raise failure
        if row.kind == PROXY_KEY:
            return AuthenticatedKey(key_id, PROXY_KEY, None)
        # The groups come from the directory at request time, so a change of groups (`rag users
        # add`) applies to keys made before it. The groups stored with the key are a record of
        # its creation, never a source of access: a user missing from the directory (a
        # database edited by hand, a key from an older version) gets no groups (fail closed).
        return AuthenticatedKey(key_id, USER_KEY, Principal(row.user, self.key_groups(row.user, row.scope)))

    def key_groups(self, user: str, scope: list[str] | tuple[str, ...] | None) -> frozenset[str]:
        """The groups a request with a user key gets now: the directory's, narrowed by the scope."""
        registered = self.registered(user)
        groups = set() if registered is None else set(registered.groups)
        if scope is not None:
            groups &= set(scope)  # a scope narrows, never widens
        return frozenset(groups)

    def list_keys(self) -> list[KeyInfo]:
        return [r.info for r in self._key_records()]

    def key_records(self) -> list[KeyRecord]:
        """Every key with its hash and admin flag, oldest first (for `rag users migrate`; never printed)."""
        return self._key_records()

    def revoke_key(self, key_id: str) -> None:
        if not self._revoke(key_id):
            raise NotFoundError(f"no API key with id {key_id!r} (see `rag keys list`)")

    # -- admin keys --------------------------------------------------------------------

    def is_admin(self, key_id: str) -> bool:
        """Whether a key is an admin key (`rag keys create --admin`).

        Admin keys see what depends on the whole store rather than on what they may read: the
        API's stage timings (a keyword search's time grows with the chunks that hold a term,
        readable or not). An unknown key, or a database that cannot say, is not an admin.
        """
        try:
            row = self._key_row(key_id)
        except self._db_errors:
            return False  # fail closed
        return row is not None and row.admin and row.kind == USER_KEY

    def admin_key_ids(self) -> set[str]:
        """The ids of every admin key (for `rag keys list`)."""
        return {r.info.key_id for r in self._key_records() if r.admin and r.info.kind == USER_KEY}


class IdentityStore(KeyDirectory):
    """Users, their groups, and API keys that stand for them, in a data directory's SQLite."""

    _db_errors = (sqlite3.Error,)

    def __init__(self, path: Path) -> None:
        private_mkdir(path.parent)
        create_private_sqlite_file(path)  # 0600 before SQLite creates it with the umask's mode (-wal/-shm follow it)

        def open_connection() -> sqlite3.Connection:
            conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            return conn

        # One connection per thread: the API authenticates from many worker threads at once.
        self._conns = ThreadConnections(open_connection)
        self.conn.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        # Catalogs from before proxy keys (every existing key stays a user key) and before
        # key scopes (NULL: the key has all of its user's groups).
        self._add_column("kind", f"TEXT NOT NULL DEFAULT '{USER_KEY}'")
        self._add_column("admin", "INTEGER NOT NULL DEFAULT 0")  # keys from before admin keys are not admins
        if self._add_column("scope", "TEXT"):
            # Before this release a key of a user missing from the directory carried its own
            # groups. From now on groups come only from the directory, so such users are
            # registered once, with their keys' groups, and keep exactly the access they had.
            for user, groups in self.conn.execute(
                    "SELECT user, groups FROM api_keys WHERE kind = ? AND revoked = 0"
                    " AND user NOT IN (SELECT name FROM users)", (USER_KEY,)).fetchall():
                known = self.registered(user)
                self.add_user(user, sorted(set(json.loads(groups)) | (known.groups if known else set())))

    def _add_column(self, name: str, declaration: str) -> bool:
        """Add a column to api_keys unless it is there; True when this call added it."""
        columns = {r[1] for r in self.conn.execute("PRAGMA table_info(api_keys)")}
        if name in columns:
            return False
        try:
            self.conn.execute(f"ALTER TABLE api_keys ADD COLUMN {name} {declaration}")
        except sqlite3.OperationalError as e:  # another process migrated it first
            if "duplicate column" not in str(e):
                raise
            return False
        return True

    @property
    def conn(self) -> sqlite3.Connection:
        return self._conns.get()

    def close(self) -> None:
        self._conns.close()

    def _put_user(self, name: str, groups: list[str]) -> None:
        self.conn.execute(
            "INSERT INTO users (name, groups, created_at) VALUES (?, ?, ?)"
            " ON CONFLICT(name) DO UPDATE SET groups = excluded.groups",
            (name, json.dumps(groups), time.time()),
        )

    def _user_rows(self) -> list[tuple[str, list[str]]]:
        return [(r[0], json.loads(r[1])) for r in self.conn.execute("SELECT name, groups FROM users ORDER BY name")]

    def _user_groups(self, name: str) -> list[str] | None:
        row = self.conn.execute("SELECT groups FROM users WHERE name = ?", (name,)).fetchone()
        return None if row is None else json.loads(row[0])

    def _insert_key(self, record: KeyRecord) -> None:
        i = record.info
        self.conn.execute(
            "INSERT INTO api_keys (key_id, key_hash, user, groups, label, created_at, revoked, kind, scope, admin)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (i.key_id, record.key_hash, i.user, json.dumps(list(i.groups)), i.label, i.created_at, int(i.revoked),
             i.kind, None if i.scope is None else json.dumps(list(i.scope)), int(record.admin)),
        )

    def _key_row(self, key_id: str) -> KeyRow | None:
        row = self.conn.execute(
            "SELECT key_hash, user, revoked, kind, scope, admin FROM api_keys WHERE key_id = ?", (key_id,)
        ).fetchone()
        if row is None:
            return None
        return KeyRow(row[0], row[1], bool(row[2]), row[3], None if row[4] is None else tuple(json.loads(row[4])),
                      row[5] == 1)

    def _key_records(self) -> list[KeyRecord]:
        return [
            KeyRecord(KeyInfo(r[0], r[1], tuple(json.loads(r[2])), r[3], r[4], bool(r[5]), r[6],
                              None if r[7] is None else tuple(json.loads(r[7]))), r[8], r[9] == 1)
            for r in self.conn.execute(
                "SELECT key_id, user, groups, label, created_at, revoked, kind, scope, key_hash, admin FROM api_keys"
                " ORDER BY created_at"
            )
        ]

    def _revoke(self, key_id: str) -> bool:
        return self.conn.execute("UPDATE api_keys SET revoked = 1 WHERE key_id = ?", (key_id,)).rowcount > 0


def _listing(groups: set[str] | frozenset[str] | list[str]) -> str:
    return ", ".join(sorted(groups)) or "(no groups)"


def system_groups(user: str) -> set[str] | None:
    """A system user's groups (primary and supplementary), or None if no such user."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return None
    groups = {g.gr_name for g in grp.getgrall() if user in g.gr_mem}
    try:
        groups.add(grp.getgrgid(pw.pw_gid).gr_name)
    except KeyError:
        pass
    return groups
