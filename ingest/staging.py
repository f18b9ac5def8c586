"""Embedded chunks of documents not yet written whole: durable per batch, invisible to readers.

A document whose chunks span several embed batches cannot go into the collection a batch at a
time (readers would see half a new version, or the old and new versions mixed), but its embedded
chunks must survive a kill, or a restart redoes all of them. They wait here, in a SQLite file of
the ingest job's own (next to the data it writes, readable by its owner only), keyed by document
and content hash, until the document's last chunk is embedded; then the whole document is written
in one store transaction and its staged rows go. A restart finds the rows of the same content and
embeds only what is missing. Nothing here is ever searched or served.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rag.private_files import create_private_sqlite_file, private_mkdir
from rag.types import Chunk

_SCHEMA = """
CREATE TABLE IF NOT EXISTS scope (id INTEGER PRIMARY KEY CHECK (id = 1), value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS staged_chunks (
    key TEXT NOT NULL, content_hash TEXT NOT NULL, idx INTEGER NOT NULL,
    text_hash TEXT NOT NULL, text TEXT NOT NULL, heading TEXT, num_tokens INTEGER NOT NULL,
    metadata TEXT NOT NULL, vector BLOB NOT NULL,
    PRIMARY KEY (key, idx)
);
"""


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class ChunkStaging:
    """Staged chunks of one collection as built by one embedder and chunking (the `scope`).

    Rows staged under another scope (another embedder, chunking or collection) are dropped when
    the file is opened: their vectors would not fit. `path=None` keeps them in memory (a library
    caller without a data directory: documents stay atomic, but a kill loses the staged work).
    """

    def __init__(self, path: Path | None, scope: str) -> None:
        self.path = path
        if path is not None:
            # Chunk text of any permission is here: only the job's owner may open the file.
            private_mkdir(path.parent)
            create_private_sqlite_file(path)
        # Ingest's writer thread stages and takes rows while the caller's thread looks up the next
        # document's: one connection, one caller at a time (`_lock`).
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path) if path is not None else ":memory:", isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL" if path is not None else "PRAGMA journal_mode=MEMORY")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT value FROM scope").fetchone()
        if row is None or row[0] != scope:
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM staged_chunks")
                self._db.execute("INSERT OR REPLACE INTO scope (id, value) VALUES (1, ?)", (scope,))
        # Keys with staged rows. The file is this ingest's alone (one run per collection at a time),
        # so the set stays exact, and `staged` of every other document (all of them, in a run that
        # resumes nothing) costs no SQL: it was a write transaction and a query per document.
        self._keys = {k for (k,) in self._db.execute("SELECT DISTINCT key FROM staged_chunks")}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def staged(self, key: str, content_hash: str) -> dict[int, str]:
        """{chunk index: text hash} staged for this version of `key`; other versions' rows are dropped."""
        if key not in self._keys:
            return {}
        with self._lock:
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM staged_chunks WHERE key = ? AND content_hash != ?",
                                 (key, content_hash))
            found = dict(self._db.execute("SELECT idx, text_hash FROM staged_chunks WHERE key = ?",
                                          (key,)).fetchall())
            if not found:
                self._keys.discard(key)
            return found

    def put(self, key: str, content_hash: str, chunks: Sequence[Chunk], vectors: np.ndarray) -> None:
        """Stage chunks with their vectors, in one transaction (all of them survive a kill, or none)."""
        assert len(chunks) == len(vectors)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        rows = [(key, content_hash, c.index, text_hash(c.text), c.text, c.heading, c.num_tokens,
                 json.dumps(c.metadata, sort_keys=True), v.tobytes()) for c, v in zip(chunks, vectors, strict=True)]
        with self._lock:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany(
                    "INSERT OR REPLACE INTO staged_chunks (key, content_hash, idx, text_hash, text, heading,"
                    " num_tokens, metadata, vector) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
            self._keys.add(key)

    def take(self, key: str, content_hash: str, dim: int) -> tuple[list[Chunk], np.ndarray]:
        """Every staged chunk of this version of `key`, by index, with its vectors (n, dim)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT idx, text, heading, num_tokens, metadata, vector FROM staged_chunks"
                " WHERE key = ? AND content_hash = ? ORDER BY idx", (key, content_hash)).fetchall()
        chunks = [Chunk(document_key=key, index=i, text=t, num_tokens=n, heading=h, metadata=json.loads(m))
                  for i, t, h, n, m, _ in rows]
        vectors = np.empty((len(rows), dim), dtype=np.float32)
        for j, row in enumerate(rows):
            vectors[j] = np.frombuffer(row[5], dtype=np.float32)
        return chunks, vectors

    def discard(self, key: str) -> None:
        with self._lock:
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM staged_chunks WHERE key = ?", (key,))
            self._keys.discard(key)

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM staged_chunks").fetchone()[0])

    def remove(self) -> None:
        """Close and delete the file: a finished run leaves no chunk text outside the collection."""
        self.close()
        if self.path is not None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
