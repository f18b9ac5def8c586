"""The embedded catalog's tables, how a connection to it is opened, and its migrations.

Migrations are idempotent and run on every open (`Catalog.__init__`): a catalog made by an older
version gains the `generation` column (versioned rebuilds) and its keyword index is rebuilt as
per-ACL-domain tables when its format is older (`keyword_index.needs_rebuild`). Each takes the
write lock only when there is something to do, so opening never waits behind a running ingest.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from rag.errors import StoreError
from rag.private_files import create_private_sqlite_file, private_mkdir
from retrieval.stores.embedded import keyword_index

SCHEMA = """
CREATE TABLE IF NOT EXISTS collections (
    name TEXT PRIMARY KEY,
    embedder TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    dim INTEGER NOT NULL,
    chunking TEXT NOT NULL,
    version INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    generation INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    collection TEXT NOT NULL REFERENCES collections(name) ON DELETE CASCADE,
    key TEXT NOT NULL,
    source TEXT NOT NULL,
    title TEXT,
    content_hash TEXT NOT NULL,
    acl TEXT NOT NULL,
    metadata TEXT NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (collection, key)
);
CREATE TABLE IF NOT EXISTS document_acl (
    document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    principal TEXT NOT NULL,
    PRIMARY KEY (principal, document_id)
);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    text TEXT NOT NULL,
    heading TEXT,
    num_tokens INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    vector BLOB NOT NULL,
    UNIQUE (document_id, idx)
);
CREATE INDEX IF NOT EXISTS chunks_by_document ON chunks(document_id);
"""


def connect(path: Path) -> sqlite3.Connection:
    """Open the catalog database with the pragmas every user of it needs."""
    private_mkdir(path.parent)
    create_private_sqlite_file(path)  # 0600 before SQLite creates it with the umask's mode (-wal/-shm follow it)
    # check_same_thread=False only so that close() may run on another thread; each connection is
    # used by the one thread that opened it (ThreadConnections).
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA synchronous=NORMAL")
    # Deleted rows and freed pages are overwritten with zeros, so a deleted document's text
    # cannot be read back from the file (the WAL is emptied by Catalog.purge_removed_text).
    conn.execute("PRAGMA secure_delete=ON")
    if conn.execute("PRAGMA secure_delete").fetchone()[0] != 1:
        conn.close()
        raise StoreError(f"SQLite refused secure_delete on {path}: deleted text would stay in the file")
    return conn


def migrate(conn: sqlite3.Connection, transaction: Callable[[], AbstractContextManager]) -> None:
    """Bring an open catalog up to date (idempotent); `transaction` opens a write transaction."""
    conn.executescript(SCHEMA)
    _ensure_generation_column(conn, transaction)
    _ensure_keyword_index(conn, transaction)


def _ensure_generation_column(conn: sqlite3.Connection, transaction: Callable[[], AbstractContextManager]) -> None:
    """Add `collections.generation` to a catalog made before rebuilds existed."""
    def has_column() -> bool:
        return any(r[1] == "generation" for r in conn.execute("PRAGMA table_info(collections)"))

    if has_column():
        return
    with transaction():
        if not has_column():  # another process may have added it while we waited
            conn.execute("ALTER TABLE collections ADD COLUMN generation INTEGER NOT NULL DEFAULT 1")


def _ensure_keyword_index(conn: sqlite3.Connection, transaction: Callable[[], AbstractContextManager]) -> None:
    """Build the per-domain keyword index of a catalog made before it existed.

    Cheap when the index is up to date (no write lock is taken). The single FTS5 table of older
    catalogs, or domains made with another tokenizer, are dropped and every chunk is indexed again.
    """
    keyword_index.create_tables(conn)
    if not keyword_index.needs_rebuild(conn):
        return
    with transaction():
        if keyword_index.needs_rebuild(conn):  # another process may have built it meanwhile
            keyword_index.rebuild_all(conn)
