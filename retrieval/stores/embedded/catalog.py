"""The SQLite catalog: collections, documents, chunks, their ACLs, vectors and keyword index.

SQLite is the source of truth of the embedded default. Vectors are kept here too (float32
blobs), so a Faiss index file is only a cache that can always be rebuilt: a crash between
a catalog commit and an index save loses nothing. Every write to a collection bumps its
`version`, which names the index file that matches it. The FTS5 keyword index lives in the
same file, one table per ACL domain (`keyword_index`), written in the same transactions as the
chunks, so it commits or rolls back with them. Tables and migrations: `catalog_schema`. Deleted text does not stay
in the file: secure_delete zeroes freed space, and `purge_removed_text` rewrites the keyword
tables that had removals and empties the WAL.

A collection rebuilt with another embedder or chunking (`retrieval.rebuild`) is written as a
hidden collection `NAME@G` (G its generation, the "version 2" users see) beside the live one,
and `promote` gives it the live name in one transaction: the live collection always carries
the plain name, so readers never need to know about generations.

Ingest writes documents in batches (`replace_document(..., batched=True)`): one transaction holds
many documents, each in a savepoint of its own, and `commit()` ends it (after each embed batch):
a crash before the commit loses the batch's documents whole, never a part of one. Any other write
(ACL change, delete, purge, rename) commits an open batch first, then runs in its own transaction.
A batch's keyword rows go into the FTS5 tables at its commit, in the same transaction, one
statement per domain: FTS5 writes its pending terms out as a new segment at every savepoint
release, so indexing each document inside its own savepoint made a segment per document (and the
merges after them), half of the catalog's write time (bench/embedded_writes.py). What an embed
batch completes is written in one `replace_documents` call: one savepoint for the documents of
the call, their ids assigned under the write lock as AUTOINCREMENT would, and a few `executemany`
statements for all their rows (1.47x the write stage of one call a document).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from rag.errors import NotFoundError, StoreError
from rag.sqlite_threads import ThreadConnections
from rag.types import Chunk, Document
from retrieval.records import (
    GENERATION_SEP,
    ChunkRecord,
    CollectionInfo,
    DocumentState,
    DocumentWrite,
    generation_name,
)
from retrieval.stores.embedded import keyword_index
from retrieval.stores.embedded.catalog_schema import connect, migrate

log = logging.getLogger(__name__)

# A batch of documents (one transaction) is committed at the latest when it holds this many.
BATCH_DOCUMENTS = 4096


class Catalog:
    """Documents, chunks, ACLs and vectors of every collection, in one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # One connection per thread: the query service reads the catalog from many at once.
        self._conns = ThreadConnections(lambda: connect(path))
        self._batch = threading.local()  # documents in this thread's open batch (its connection's)
        try:
            migrate(self.conn, self._transaction)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot open catalog {path}: {e}; is it a RAG data directory?") from e

    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's connection to the catalog."""
        return self._conns.get()

    def close(self) -> None:
        """Commit this thread's open batch (its documents are whole), then close every connection."""
        try:
            self.commit()
        finally:
            self._conns.close()

    def release_thread(self) -> None:
        """Commit this thread's open batch, then close its connection (the thread is done with the catalog)."""
        try:
            self.commit()
        finally:
            self._conns.release()

    def commit(self) -> None:
        """Commit this thread's open batch of `replace_document(..., batched=True)` writes (if any).

        The batch's keyword rows are indexed first, in its transaction: if that fails, the whole
        batch rolls back (no document is committed without its keyword rows) and the error rises.
        """
        if not getattr(self._batch, "open", False):
            return
        try:
            if self.conn.in_transaction:  # else SQLite rolled it back already (a failed statement)
                self._index_batch_keywords()
                self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        finally:
            self._batch.open, self._batch.documents, self._batch.keywords = False, 0, {}

    @property
    def batch_documents(self) -> int:
        """Documents written in this thread's open batch, not committed yet."""
        return getattr(self._batch, "documents", 0)

    # -- collections -------------------------------------------------------------------

    def create_collection(
        self, name: str, embedder: str, fingerprint: str, dim: int, chunking: dict,
        generation: int = 1,
    ) -> CollectionInfo:
        """Create a collection, or check that an existing one matches the embedder."""
        existing = self.find_collection(name)
        if existing is not None:
            if existing.fingerprint != fingerprint or existing.dim != dim:
                raise StoreError(
                    f"collection {name!r} was built with embedder {existing.embedder} "
                    f"({existing.dim} dims); this run uses {embedder} ({dim} dims). "
                    "Use the same embedder, or ingest into a new collection."
                )
            return existing
        self.conn.execute(
            "INSERT INTO collections (name, embedder, fingerprint, dim, chunking, created_at, generation)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (name, embedder, fingerprint, dim, json.dumps(chunking, sort_keys=True), time.time(),
             generation),
        )
        return self.get_collection(name)

    def find_collection(self, name: str) -> CollectionInfo | None:
        row = self.conn.execute(
            "SELECT name, embedder, fingerprint, dim, chunking, version, generation FROM collections"
            " WHERE name = ?",
            (name,),
        ).fetchone()
        if row is None:
            return None
        return CollectionInfo(row[0], row[1], row[2], row[3], json.loads(row[4]), row[5], row[6])

    def get_collection(self, name: str) -> CollectionInfo:
        """Raises NotFoundError naming the collections that do exist."""
        info = self.find_collection(name)
        if info is None:
            names = self.collection_names()
            have = ", ".join(names) if names else "none yet; run `rag ingest PATH` first"
            raise NotFoundError(f"unknown collection {name!r} (collections: {have})")
        return info

    def _dim(self, name: str) -> int:
        """The collection's vector size (one column: a write checks it for every document)."""
        row = self.conn.execute("SELECT dim FROM collections WHERE name = ?", (name,)).fetchone()
        # None: get_collection raises the NotFoundError that names the others.
        return int(row[0]) if row is not None else self.get_collection(name).dim

    def collection_names(self) -> list[str]:
        """The live collections (hidden generations being built or dropped are left out)."""
        return [r[0] for r in self.conn.execute("SELECT name FROM collections ORDER BY name")
                if GENERATION_SEP not in r[0]]

    def hidden_generations(self, name: str) -> list[CollectionInfo]:
        """The hidden generations of collection `name` (being built, or left to drop), by generation."""
        prefix = name + GENERATION_SEP
        names = [r[0] for r in self.conn.execute("SELECT name FROM collections")
                 if r[0].startswith(prefix) and r[0][len(prefix):].isdigit()]
        infos = [info for n in names if (info := self.find_collection(n)) is not None]
        return sorted(infos, key=lambda i: i.generation)

    def promote(self, name: str, build: str) -> str:
        """Give the hidden collection `build` the name `name`, in one transaction.

        The live collection becomes the hidden generation it was (to be dropped with
        `drop_collection`); `build` takes its name with a version above any the live one had,
        so every reader reloads, and a reader sees either the old or the new one, never a mix.

        Returns:
            The name the old collection now has.
        """
        with self._transaction():
            live = self.get_collection(name)
            self.get_collection(build)
            retired = generation_name(name, live.generation)
            assert self.find_collection(retired) is None, retired
            self._rename(name, retired, live.version)
            self._rename(build, name, live.version + 1)
        return retired

    def drop_collection(self, name: str, batch: int = 256) -> int:
        """Delete a collection with its documents, chunks and vectors; returns documents deleted.

        Documents go in batches of their own transactions, so a big collection never holds the
        write lock for long; an interrupted drop leaves a smaller collection to drop again.
        """
        deleted = 0
        while True:
            with self._transaction():
                docs = self.conn.execute(
                    "SELECT id, acl FROM documents WHERE collection = ? LIMIT ?", (name, batch)).fetchall()
                if not docs:
                    keyword_index.drop_collection_domains(self.conn, name)
                    self.conn.execute("DELETE FROM collections WHERE name = ?", (name,))
                else:
                    for doc_id, acl in docs:
                        keyword_index.unindex_chunks(self.conn, name, acl, self._chunk_texts(doc_id))
                    marks = ",".join("?" * len(docs))
                    self.conn.execute(f"DELETE FROM documents WHERE id IN ({marks})", [d[0] for d in docs])
                    self._bump(name)
            if not docs:
                self.purge_removed_text()  # the dropped text may still sit in the WAL
                return deleted
            deleted += len(docs)

    def missing_documents(self, collection: str, other: str, limit: int = 5) -> tuple[int, list[str]]:
        """Documents of `collection` that `other` lacks: (how many, the first `limit` keys)."""
        where = (" FROM documents d WHERE d.collection = ? AND NOT EXISTS"
                 " (SELECT 1 FROM documents o WHERE o.collection = ? AND o.key = d.key)")
        count = self.conn.execute("SELECT COUNT(*)" + where, (collection, other)).fetchone()[0]
        keys = [r[0] for r in self.conn.execute(
            "SELECT d.key" + where + " ORDER BY d.key LIMIT ?", (collection, other, limit))]
        return int(count), keys

    def version(self, collection: str) -> int:
        row = self.conn.execute(
            "SELECT version FROM collections WHERE name = ?", (collection,)
        ).fetchone()
        if row is None:
            raise NotFoundError(f"unknown collection {collection!r}")
        return int(row[0])

    def collection_stats(self, collection: str) -> dict[str, int]:
        docs = self.conn.execute(
            "SELECT COUNT(*) FROM documents WHERE collection = ?", (collection,)
        ).fetchone()[0]
        chunks = self.conn.execute(
            "SELECT COUNT(*) FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.collection = ?",
            (collection,),
        ).fetchone()[0]
        return {"documents": int(docs), "chunks": int(chunks)}

    # -- documents ---------------------------------------------------------------------

    def document_states(self, collection: str) -> dict[str, DocumentState]:
        """Every stored document of a collection by key (for incremental ingest)."""
        rows = self.conn.execute(
            "SELECT d.id, d.key, d.content_hash, d.acl,"
            " (SELECT COUNT(*) FROM chunks c WHERE c.document_id = d.id)"
            " FROM documents d WHERE d.collection = ?",
            (collection,),
        )
        # Most documents share a handful of ACLs: one frozenset per distinct ACL keeps this
        # map at a few hundred bytes per document (it is held for a whole ingest run).
        acls: dict[str, frozenset[str]] = {}

        def acl(text: str) -> frozenset[str]:
            shared = acls.get(text)
            if shared is None:
                shared = acls[text] = frozenset(json.loads(text))
            return shared

        return {r[1]: DocumentState(r[0], r[1], r[2], acl(r[3]), r[4]) for r in rows}

    def replace_document(
        self, collection: str, doc: Document, acl: frozenset[str], chunks: Sequence[Chunk],
        vectors: np.ndarray, batched: bool = False,
    ) -> tuple[list[int], list[int]]:
        """Write a document with its chunks and vectors in one transaction.

        Args:
            batched: join this thread's open batch (opening one if none is): the document is
                written in a savepoint and committed with the batch (`commit`, or any other
                write; at the latest at `BATCH_DOCUMENTS` documents), whole or not at all.

        Returns (chunk ids removed, chunk ids added) so the vector index can follow.
        An interrupted call leaves the previous version intact.
        """
        return self.replace_documents(collection, [DocumentWrite(doc, acl, chunks, vectors)], batched)[0]

    def replace_documents(
        self, collection: str, writes: Sequence[DocumentWrite], batched: bool = False,
    ) -> list[tuple[list[int], list[int]]]:
        """`replace_document` for several documents at once, all or none: one savepoint (batched) or
        transaction for all of them, and a few statements for all their rows (ids assigned here,
        under the write lock, as AUTOINCREMENT would) instead of several for each document. What
        ingest writes after each embed batch. Returns (chunk ids removed, chunk ids added) per
        document, in order.
        """
        if len({w.doc.key for w in writes}) < len(writes):  # one document twice: one write after the other
            return [self.replace_documents(collection, [w], batched)[0] for w in writes]
        dim = self._dim(collection)
        for w in writes:
            assert len(w.chunks) == len(w.vectors)
            if len(w.chunks) and w.vectors.shape[1] != dim:
                raise StoreError(
                    f"vectors have {w.vectors.shape[1]} dims but collection {collection!r} has {dim}"
                )
        results: list[tuple[list[int], list[int]]] = []
        keywords: list[tuple[str, list[keyword_index.ChunkText]]] = []
        with self._savepoint() if batched else self._transaction():
            removed = self._delete_documents(collection, [w.doc.key for w in writes])
            doc_id, chunk_id = self._next_id("documents"), self._next_id("chunks")
            doc_rows, acl_rows, chunk_rows = [], [], []
            now = time.time()
            for w in writes:
                doc = w.doc
                acl_json = json.dumps(sorted(w.acl))
                doc_rows.append((doc_id, collection, doc.key, doc.source, doc.title, doc.content_hash, acl_json,
                                 json.dumps(doc.metadata, sort_keys=True, default=str), now))
                acl_rows.extend((doc_id, principal) for principal in sorted(w.acl))
                added = list(range(chunk_id, chunk_id + len(w.chunks)))
                vectors = np.ascontiguousarray(w.vectors, dtype=np.float32)
                chunk_rows.extend(
                    (cid, doc_id, c.index, c.text, c.heading, c.num_tokens, _json_object(c.metadata), v.tobytes())
                    for cid, c, v in zip(added, w.chunks, vectors, strict=True)
                )
                keywords.append((acl_json, [(cid, c.text, c.heading, c.num_tokens)
                                            for cid, c in zip(added, w.chunks, strict=True)]))
                results.append((removed.get(doc.key, []), added))
                doc_id += 1
                chunk_id += len(w.chunks)
            self.conn.executemany(
                "INSERT INTO documents (id, collection, key, source, title, content_hash, acl, metadata,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", doc_rows)
            self.conn.executemany("INSERT INTO document_acl (document_id, principal) VALUES (?, ?)", acl_rows)
            self.conn.executemany(
                "INSERT INTO chunks (id, document_id, idx, text, heading, num_tokens, metadata, vector)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", chunk_rows)
            if not batched:
                for acl_json, texts in keywords:
                    keyword_index.index_chunks(self.conn, collection, acl_json, texts)
            self.conn.execute("UPDATE collections SET version = version + ? WHERE name = ?",
                              (len(writes), collection))  # one bump per document, as replace_document
        if batched:
            for acl_json, texts in keywords:  # indexed at the batch's commit, as replace_document's
                self._batch.keywords.setdefault((collection, acl_json), {}).update({t[0]: t for t in texts})
            self._batch.documents = self.batch_documents + len(writes)
            if self._batch.documents >= BATCH_DOCUMENTS:
                self.commit()
        return results

    def set_acl(self, collection: str, key: str, acl: frozenset[str]) -> None:
        """Change who may read a document without touching its chunks or vectors."""
        with self._transaction():
            row = self.conn.execute(
                "SELECT id, acl FROM documents WHERE collection = ? AND key = ?", (collection, key)
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no document {key!r} in collection {collection!r}")
            new_acl = json.dumps(sorted(acl))
            if new_acl != row[1]:
                # The chunks move to the new ACL's domain; the old one is purged of them later.
                texts = self._chunk_texts(row[0])
                keyword_index.unindex_chunks(self.conn, collection, row[1], texts)
                keyword_index.index_chunks(self.conn, collection, new_acl, texts)
            self.conn.execute(
                "UPDATE documents SET acl = ?, updated_at = ? WHERE id = ?",
                (new_acl, time.time(), row[0]),
            )
            self.conn.execute("DELETE FROM document_acl WHERE document_id = ?", (row[0],))
            self._write_acl(row[0], acl)
            self._bump(collection)

    def delete_document(self, collection: str, key: str) -> list[int]:
        """Delete a document and its chunks; returns the removed chunk ids."""
        with self._transaction():
            removed = self._delete_document(collection, key)
            self._bump(collection)
        return removed

    # -- reads for retrieval -----------------------------------------------------------

    def allowed_chunk_ids(self, collection: str, tokens: Iterable[str]) -> np.ndarray:
        """Ids of the chunks whose document ACL names one of `tokens` (int64, sorted)."""
        tokens = sorted(set(tokens))
        if not tokens:
            return np.empty(0, dtype=np.int64)
        marks = ",".join("?" * len(tokens))
        rows = self.conn.execute(
            "SELECT DISTINCT c.id FROM document_acl a"
            " JOIN documents d ON d.id = a.document_id"
            " JOIN chunks c ON c.document_id = d.id"
            f" WHERE d.collection = ? AND a.principal IN ({marks}) ORDER BY c.id",
            (collection, *tokens),
        ).fetchall()
        return np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))

    def keyword_search(self, collection: str, text: str, k: int, tokens: Iterable[str]) -> list[tuple[int, float]]:
        """BM25 top-k among the chunks `tokens` may read (see `keyword_index.search`)."""
        self._index_batch_keywords()  # this thread's own open batch, as its other reads see it
        return keyword_index.search(self.conn, collection, text, k, tokens)

    def purge_removed_text(self) -> bool:
        """Make deleted and replaced text unreadable in the catalog's files.

        Rewrites the keyword tables of domains that had removals (see `keyword_index.purge`)
        and empties the WAL, whose old frames would otherwise still hold the pages as they were
        before the deletion. Cheap when nothing was removed. Call after a batch of writes
        (`EmbeddedCollection.save` does).

        Returns:
            False when a reader kept the WAL from being emptied (logged; the next call tries
            again): the text is unreachable through the catalog but may remain in the -wal file.
        """
        if keyword_index.needs_purge(self.conn):
            with self._transaction():
                keyword_index.purge(self.conn)
        if not self._wal_has_frames():
            return True
        busy, _, _ = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            log.warning("could not empty the WAL of %s (a long-running reader?); removed text may "
                        "remain in its -wal file until the next purge", self.path)
        return not busy

    def _wal_has_frames(self) -> bool:
        wal = self.path.with_name(self.path.name + "-wal")
        return wal.exists() and wal.stat().st_size > 0

    def chunk_records(self, ids: Sequence[int], collection: str) -> dict[int, ChunkRecord]:
        """Chunks of `collection` by id with their document's key, source, title and ACL.

        Chunk ids are unique across the catalog, but an id of another collection is not found:
        `/v1/documents/A/{id}` must never show a chunk of collection B under A's name.
        """
        out: dict[int, ChunkRecord] = {}
        ids = [int(i) for i in ids]
        for start in range(0, len(ids), 500):
            part = ids[start : start + 500]
            marks = ",".join("?" * len(part))
            for r in self.conn.execute(
                "SELECT c.id, d.key, d.source, d.title, c.idx, c.text, c.heading, d.acl"
                " FROM chunks c JOIN documents d ON d.id = c.document_id"
                f" WHERE d.collection = ? AND c.id IN ({marks})",
                [collection, *part],
            ):
                out[r[0]] = ChunkRecord(
                    r[0], r[1], r[2], r[3], r[4], r[5], r[6], frozenset(json.loads(r[7]))
                )
        return out

    def iter_vectors(self, collection: str, batch: int = 8192) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids int64, vectors float32 (n, dim)) of a collection in id order, `batch` rows at a time.

        Rebuilding an index this way holds one batch of rows beside the index, not a second
        copy of every vector.
        """
        info = self.get_collection(collection)
        cur = self.conn.execute(
            "SELECT c.id, c.vector FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.collection = ? ORDER BY c.id",
            (collection,),
        )
        while rows := cur.fetchmany(batch):
            ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
            vecs = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), info.dim)
            yield ids, vecs

    def vectors(self, collection: str) -> tuple[np.ndarray, np.ndarray]:
        """All (ids int64, vectors float32) of a collection, to rebuild an index."""
        info = self.get_collection(collection)
        rows = self.conn.execute(
            "SELECT c.id, c.vector FROM chunks c JOIN documents d ON d.id = c.document_id"
            " WHERE d.collection = ? ORDER BY c.id",
            (collection,),
        ).fetchall()
        ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        vecs = np.empty((len(rows), info.dim), dtype=np.float32)
        for i, r in enumerate(rows):
            vecs[i] = np.frombuffer(r[1], dtype=np.float32)
        return ids, vecs

    def dump(self, collection: str) -> list[dict]:
        """A canonical, id-free view of a collection (for comparing two ingests)."""
        rows = self.conn.execute(
            "SELECT d.key, d.content_hash, d.acl, d.title, c.idx, c.text, c.heading, c.vector"
            " FROM documents d LEFT JOIN chunks c ON c.document_id = d.id"
            " WHERE d.collection = ? ORDER BY d.key, c.idx",
            (collection,),
        )
        return [
            {
                "key": r[0], "hash": r[1], "acl": json.loads(r[2]), "title": r[3], "index": r[4],
                "text": r[5], "heading": r[6],
                "vector": None if r[7] is None else np.frombuffer(r[7], dtype=np.float32),
            }
            for r in rows
        ]

    # -- internals ---------------------------------------------------------------------

    def _rename(self, old: str, new: str, version: int) -> None:
        # A new row, the documents moved over, the old row dropped: each statement leaves
        # every document pointing at an existing collection, so no foreign key is deferred.
        self.conn.execute(
            "INSERT INTO collections (name, embedder, fingerprint, dim, chunking, version, created_at,"
            " generation) SELECT ?, embedder, fingerprint, dim, chunking, ?, created_at, generation"
            " FROM collections WHERE name = ?",
            (new, version, old),
        )
        self.conn.execute("UPDATE documents SET collection = ? WHERE collection = ?", (new, old))
        keyword_index.rename_collection(self.conn, old, new)
        self.conn.execute("DELETE FROM collections WHERE name = ?", (old,))

    def _delete_document(self, collection: str, key: str) -> list[int]:
        row = self.conn.execute(
            "SELECT id, acl FROM documents WHERE collection = ? AND key = ?", (collection, key)
        ).fetchone()
        if row is None:
            return []
        rows = self._chunk_texts(row[0])
        queued = self._batch_keywords().get((collection, row[1]), {})
        if rows and rows[0][0] in queued:  # written earlier in this batch: never indexed
            for r in rows:
                del queued[r[0]]
        else:
            keyword_index.unindex_chunks(self.conn, collection, row[1], rows)
        self.conn.execute("DELETE FROM documents WHERE id = ?", (row[0],))
        return [r[0] for r in rows]

    def _delete_documents(self, collection: str, keys: Sequence[str]) -> dict[str, list[int]]:
        """Delete those of these documents that exist (one query finds them); key -> removed chunk ids."""
        found: list[str] = []
        for i in range(0, len(keys), 500):  # SQLite's limit on bound parameters is far above 500
            part = keys[i:i + 500]
            marks = ",".join("?" * len(part))
            found += [r[0] for r in self.conn.execute(
                f"SELECT key FROM documents WHERE collection = ? AND key IN ({marks})", (collection, *part))]
        return {key: self._delete_document(collection, key) for key in found}

    def _next_id(self, table: str) -> int:
        """The id AUTOINCREMENT would give the next row of `table` (documents or chunks).

        Read under the write lock (inside the batch's transaction), so no other writer takes it;
        a row inserted with a larger explicit id moves sqlite_sequence on, as AUTOINCREMENT would.
        """
        assert table in ("documents", "chunks")
        seq, top = self.conn.execute(
            f"SELECT (SELECT seq FROM sqlite_sequence WHERE name = ?), (SELECT max(id) FROM {table})", (table,)
        ).fetchone()
        return max(seq or 0, top or 0) + 1

    def _batch_keywords(self) -> dict[tuple[str, str], dict[int, keyword_index.ChunkText]]:
        """This thread's batch's keyword rows not indexed yet: (collection, ACL JSON) -> id -> row."""
        if not hasattr(self._batch, "keywords"):
            self._batch.keywords = {}
        return self._batch.keywords

    def _index_batch_keywords(self) -> None:
        """Index the queued keyword rows of this thread's open batch (inside its transaction)."""
        queued = self._batch_keywords()
        if not self.conn.in_transaction:
            queued.clear()  # SQLite rolled the batch back: its chunks are gone too
            return
        while queued:
            (collection, acl), rows = queued.popitem()
            keyword_index.index_chunks(self.conn, collection, acl, list(rows.values()))

    def _chunk_texts(self, doc_id: int) -> list[keyword_index.ChunkText]:
        """(id, text, heading, num_tokens) of a document's chunks, as the keyword index holds them."""
        return self.conn.execute(
            "SELECT id, text, heading, num_tokens FROM chunks WHERE document_id = ? ORDER BY id", (doc_id,)
        ).fetchall()

    def _write_acl(self, doc_id: int, acl: frozenset[str]) -> None:
        self.conn.executemany(
            "INSERT INTO document_acl (document_id, principal) VALUES (?, ?)",
            [(doc_id, p) for p in sorted(acl)],
        )

    def _bump(self, collection: str) -> None:
        self.conn.execute(
            "UPDATE collections SET version = version + 1 WHERE name = ?", (collection,)
        )

    def _transaction(self) -> _Transaction:
        self.commit()  # an open batch goes first: this write commits on its own
        return _Transaction(self.conn)

    def _savepoint(self) -> _Savepoint:
        if getattr(self._batch, "open", False) and not self.conn.in_transaction:
            # SQLite rolled the open batch back (a failed statement, disk full): its queued keyword
            # rows name chunk ids that the next inserts will reuse, so they go with it.
            self._batch.open, self._batch.keywords = False, {}
        if not getattr(self._batch, "open", False):
            self.conn.execute("BEGIN IMMEDIATE")
            self._batch.open, self._batch.documents, self._batch.keywords = True, 0, {}
        return _Savepoint(self.conn)


def _json_object(values: dict) -> str:
    """A metadata dict as the catalog stores it (most chunks have none: no encoder call)."""
    return json.dumps(values, sort_keys=True, default=str) if values else "{}"


class _Savepoint:
    """One document of a batch: released into the batch, or rolled back alone on any exception."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("SAVEPOINT document")

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.conn.in_transaction:
            return  # SQLite rolled the whole batch back (disk full, I/O error): nothing to release
        if exc_type is not None:
            self.conn.execute("ROLLBACK TO document")
        self.conn.execute("RELEASE document")


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception (one writer at a time)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")
