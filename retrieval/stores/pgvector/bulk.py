"""Batched writes of a pgvector collection: many documents per transaction, the HNSW graph built after a bulk load.

A write of one document per transaction spent most of its time outside the rows themselves:
an HNSW insert per chunk (several times the cost of building the graph in memory at the end),
and a commit per document. Here `PgvectorCollection` buffers whole documents (`WriteBuffer`)
and `write_documents` commits a batch in one transaction: the documents' rows upserted in key
order from a temporary table (so concurrent writers lock shared keys in the same order and
never deadlock), the old chunks of updated documents deleted, every chunk COPYed in binary,
the keyword domains recorded. A document is still never half-written: a batch commits whole.

A collection or rebuilt version created empty by an ingest has no keyword or HNSW index yet
(`IndexLoad`): writers hold a shared advisory lock on it while they load, and the one that ends
its load last (it gets the lock exclusively) builds both with a `maintenance_work_mem` sized for
them: the keyword index (schema migration 5) from every chunk's keys sorted in memory, the HNSW
graph in memory. Once they exist, writes maintain them incrementally as before. A writer killed
mid-load drops its lock with its connection; the next writer to end a load builds them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from retrieval.stores.pgvector.schema import (
    MAX_HNSW_DIM,
    HnswParams,
    create_hnsw_index,
    create_keyword_index,
    hnsw_index_exists,
    hnsw_index_options,
    keyword_index_exists,
)

log = logging.getLogger(__name__)

DEFAULT_BATCH_DOCUMENTS = 256
DEFAULT_BATCH_BYTES = 50 * 1024 * 1024
# The most memory an index build may ask for (maintenance_work_mem); below it, what the graph needs.
DEFAULT_INDEX_MEMORY_MB = 1024

CHUNK_COLUMNS = ("id", "collection", "document_key", "idx", "text", "heading", "num_tokens", "metadata",
                 "acl", "embedding")
CHUNK_TYPES = ["int8", "text", "text", "int4", "text", "text", "int4", "jsonb", "text[]", "vector"]
_DOCUMENT_COLUMNS = ("key", "source", "title", "content_hash", "acl", "metadata", "num_chunks")
_DOCUMENT_TYPES = ["text", "text", "text", "text", "text[]", "jsonb", "int4"]

_COPY_CHUNKS = sql.SQL("COPY rag_chunks ({}) FROM STDIN (FORMAT BINARY)").format(
    sql.SQL(", ").join(map(sql.Identifier, CHUNK_COLUMNS)))
_UPSERT_SET = (" ON CONFLICT (collection, key) DO UPDATE SET source = EXCLUDED.source, title = EXCLUDED.title,"
               " content_hash = EXCLUDED.content_hash, acl = EXCLUDED.acl, metadata = EXCLUDED.metadata,"
               " num_chunks = EXCLUDED.num_chunks, updated_at = now() RETURNING key, xmax = 0")  # true: new row


@dataclass
class PendingDocument:
    """A document's rows, ready to write: (key, source, title, hash, acl, metadata, num_chunks) and its chunks."""

    key: str
    row: tuple
    acl: list[str]
    chunks: list[tuple]
    nbytes: int


class WriteBuffer:
    """Whole documents waiting for their batch's transaction; a later version of a key replaces an earlier one."""

    def __init__(self, max_documents: int, max_bytes: int) -> None:
        self.max_documents = max_documents
        self.max_bytes = max_bytes
        self._documents: dict[str, PendingDocument] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._documents)

    def add(self, document: PendingDocument) -> bool:
        """Queue a document; True when the batch is full and should be written now."""
        old = self._documents.pop(document.key, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._documents[document.key] = document
        self._bytes += document.nbytes
        return len(self._documents) >= self.max_documents or self._bytes >= self.max_bytes

    def take(self) -> list[PendingDocument]:
        """Everything queued, in order; the buffer is empty after."""
        documents, self._documents, self._bytes = list(self._documents.values()), {}, 0
        return documents


def write_documents(conn: psycopg.Connection, collection: str, documents: list[PendingDocument],
                    durable: Callable[[psycopg.Connection], None],
                    add_domain: Callable[[psycopg.Connection, list[str]], None]) -> None:
    """Write `documents` of `collection` (physical name) in the caller's transaction, replacing older versions.

    Args:
        durable: called when a document is replaced (its new version may grant less), so the
            commit waits for its WAL flush.
        add_domain: records an ACL's keyword domain (once per distinct ACL of the batch).
    """
    if len(documents) == 1:
        updated = _upsert_one(conn, collection, documents[0])
    else:
        updated = _upsert_many(conn, collection, documents)
    if updated:
        durable(conn)
        conn.execute("DELETE FROM rag_chunks WHERE collection = %s AND document_key = ANY(%s::text[])",
                     (collection, updated))
    if any(d.chunks for d in documents):
        with conn.cursor() as cur, cur.copy(_COPY_CHUNKS) as copy:
            copy.set_types(CHUNK_TYPES)
            for document in documents:
                for row in document.chunks:
                    copy.write_row(row)
    for acl in sorted({tuple(d.acl) for d in documents if d.chunks}):
        add_domain(conn, list(acl))


def _upsert_one(conn: psycopg.Connection, collection: str, document: PendingDocument) -> list[str]:
    """The document row of a batch of one (the statement a write per document has always used)."""
    key, inserted = conn.execute(
        "INSERT INTO rag_documents (collection, key, source, title, content_hash, acl, metadata, num_chunks)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)" + _UPSERT_SET, (collection, *document.row)).fetchone()
    return [] if inserted else [key]


def _upsert_many(conn: psycopg.Connection, collection: str, documents: list[PendingDocument]) -> list[str]:
    """Upsert the batch's document rows in key order; returns the keys that existed (replaced, not new).

    Each upsert takes its document's row lock (a concurrent writer of the same key waits until we
    commit, then replaces exactly the chunks we wrote); taking them in one order everywhere (byte
    order of the key) keeps two batches that share keys from deadlocking.
    """
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS rag_pending_documents (key text, source text, title text,"
                 " content_hash text, acl text[], metadata jsonb, num_chunks integer) ON COMMIT DELETE ROWS")
    with conn.cursor() as cur, cur.copy(sql.SQL("COPY rag_pending_documents ({}) FROM STDIN (FORMAT BINARY)")
                                        .format(sql.SQL(", ").join(map(sql.Identifier, _DOCUMENT_COLUMNS)))) as copy:
        copy.set_types(_DOCUMENT_TYPES)
        for document in documents:
            copy.write_row(document.row)
    rows = conn.execute(
        "INSERT INTO rag_documents (collection, key, source, title, content_hash, acl, metadata, num_chunks)"
        " SELECT %s, key, source, title, content_hash, acl, metadata, num_chunks FROM rag_pending_documents"
        ' ORDER BY key COLLATE "C"' + _UPSERT_SET, (collection,)).fetchall()
    return [key for key, inserted in rows if not inserted]


def load_lock_key(collection: str) -> int:
    """The advisory lock key (a signed bigint) that a collection's loaders share."""
    digest = hashlib.blake2b(f"rag_load\0{collection}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class IndexLoad:
    """Whether this writer is bulk-loading a collection that lacks its indexes (see the module docstring).

    Decided at the first write: with the indexes present, writes maintain them (incremental);
    without, this writer holds the collection's load lock shared until `end`, and the last
    loader to end builds them.
    """

    def __init__(self, collection: str, dim: int, max_memory_mb: int, hnsw: HnswParams) -> None:
        self.collection = collection
        self.dim = dim
        self.max_memory_mb = max_memory_mb
        self.hnsw = hnsw  # the graph parameters of the HNSW index this load's end builds
        self.key = load_lock_key(collection)
        self.is_loading: bool | None = None  # None: not decided yet

    def indexes_exist(self, conn: psycopg.Connection) -> bool:
        """Whether the keyword index and (for at most MAX_HNSW_DIM dimensions) the HNSW index exist."""
        return keyword_index_exists(conn, self.collection) and (
            self.dim > MAX_HNSW_DIM or hnsw_index_exists(conn, self.collection))

    def before_write(self, conn: psycopg.Connection) -> None:
        """Join the load if the collection lacks its indexes (waits while someone builds them)."""
        if self.is_loading is not None:
            return
        conn.execute("SELECT pg_advisory_lock_shared(%s)", (self.key,))
        self.is_loading = not self.indexes_exist(conn)
        if not self.is_loading:
            conn.execute("SELECT pg_advisory_unlock_shared(%s)", (self.key,))
            built = hnsw_index_options(conn, self.collection)
            if built is not None and built != self.hnsw:
                log.info("the HNSW index of %r keeps the graph it was built with (m %d, ef_construction %d); "
                         "m %d, ef_construction %d apply to indexes built from now on (a new collection, or "
                         "the next version of this one)", self.collection, built.m, built.ef_construction,
                         self.hnsw.m, self.hnsw.ef_construction)

    def forget(self) -> None:
        """The connection was lost (and its locks with it): decide again at the next write."""
        self.is_loading = None

    def end(self, conn: psycopg.Connection, wait: bool,
            connect: Callable[[], psycopg.Connection] | None = None) -> bool:
        """Leave the load; if no other writer is loading (or, with `wait`, once none is), build the indexes.

        Runs in the caller's transaction. With `connect` (a new autocommit connection to the same
        database), the keyword index is built on that second connection while this one builds
        the HNSW graph: two server processes, where one after the other leaves a core idle
        (each may take the `maintenance_work_mem` of `index_memory_mb`, so twice that together).
        Returns whether the indexes exist now (as far as this writer knows: another loader may
        still be writing and build them when it ends).
        """
        if self.is_loading:
            conn.execute("SELECT pg_advisory_unlock_shared(%s)", (self.key,))
        self.is_loading = None
        if wait:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.key,))
        elif not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (self.key,)).fetchone()[0]:
            return False  # others are still loading: the last of them builds them
        if self.indexes_exist(conn):
            return True
        rows = int(conn.execute("SELECT count(*) FROM rag_chunks WHERE collection = %s",
                                (self.collection,)).fetchone()[0])
        memory_mb = index_memory_mb(rows, self.dim, self.max_memory_mb, self.hnsw.m)
        conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(sql.Literal(f"{memory_mb}MB")))
        log.info("building the keyword and HNSW indexes of %r over %d chunks (HNSW m %d, ef_construction %d; "
                 "maintenance_work_mem %d MB)", self.collection, rows, self.hnsw.m, self.hnsw.ef_construction,
                 memory_mb)
        need_keyword = not keyword_index_exists(conn, self.collection)
        need_hnsw = self.dim <= MAX_HNSW_DIM and not hnsw_index_exists(conn, self.collection)
        if need_keyword and need_hnsw and connect is not None:
            with SideIndexBuild(connect, self.collection, memory_mb):
                create_hnsw_index(conn, self.collection, self.dim, self.hnsw)
            return True
        if need_keyword:
            create_keyword_index(conn, self.collection)
        if need_hnsw:
            create_hnsw_index(conn, self.collection, self.dim, self.hnsw)
        return True


class SideIndexBuild:
    """A keyword index built on a connection of its own, in a thread, while the caller builds the HNSW index.

    Each build commits on its own connection; one that fails or is killed leaves the other
    index (or none), and the next loader to end builds what is missing (`IndexLoad.indexes_exist`).
    The side connection takes its SHARE lock on rag_chunks before the caller's CREATE INDEX
    asks for its own: otherwise a writer of another collection queued between the two (waiting
    for the caller's lock) would make it wait for the caller, which waits for it in this process,
    a deadlock the server cannot see.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection], collection: str, memory_mb: int) -> None:
        self._connect = connect
        self.collection = collection
        self.memory_mb = memory_mb
        self._locked = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"keyword-index-{collection}", daemon=True)

    def _run(self) -> None:
        try:
            with self._connect() as conn, conn.transaction():
                conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(sql.Literal(f"{self.memory_mb}MB")))
                conn.execute("LOCK TABLE rag_chunks IN SHARE MODE")
                self._locked.set()
                create_keyword_index(conn, self.collection)
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e
        finally:
            self._locked.set()

    def __enter__(self) -> SideIndexBuild:
        self._thread.start()
        self._locked.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join()  # also when the caller's build failed: never leave the side build running
        if self._error is not None and exc[0] is None:
            raise self._error


def index_memory_mb(rows: int, dim: int, max_mb: int, m: int = 16) -> int:
    """maintenance_work_mem for the index builds after a load of `rows` chunks: the HNSW graph in memory
    (pgvector builds far faster while it fits), with a margin, at least 64 MB and at most `max_mb`.

    Per element: the vector (4 bytes a dimension), its neighbour lists (2m entries of 16 bytes on
    layer 0, for the HNSW `m`; the few upper layers add little) and pgvector's element header.
    Measured with pgvector 0.8.6 at 384 dimensions (where its build notices that the graph no
    longer fits): 2,252 / 2,764 / 3,273 bytes an element at m 16 / 32 / 48, this formula less
    its margin. The keyword index's build (each chunk's ~110 keys, 6 bytes a posting plus each
    distinct key once) needs less.
    """
    need = rows * (dim * 4 + 2 * m * 16 + 200) * 1.3 / 2**20
    return int(max(64, min(max_mb, need)))
