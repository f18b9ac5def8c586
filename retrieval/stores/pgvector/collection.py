"""The pgvector store: a collection's documents, chunks, ACLs and vectors in shared PostgreSQL.

Open one with `create_collection(dsn, ...)` (creates or checks) or `open_collection(dsn, name)`.
An ingest's writes are buffered and committed a batch of documents per transaction (`bulk`);
every read, `save`, `finish` and `close` commits what is buffered first. Each batch locks its document rows,
so parallel ingest shards and several processes can write at once without losing or
duplicating chunks. The ACL filter is a
condition of the index scan itself (`acl && tokens`), with pgvector's iterative scan, so a
principal who may read few chunks still gets up to k of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from functools import partial

import numpy as np
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from rag.errors import ConfigError, NotFoundError, StoreError
from rag.types import Chunk, Document
from retrieval.keyword import query_terms
from retrieval.records import GENERATION_SEP, ChunkRecord, CollectionInfo, DocumentState, DocumentWrite
from retrieval.stores.pgvector.bulk import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_INDEX_MEMORY_MB,
    IndexLoad,
    PendingDocument,
    WriteBuffer,
    write_documents,
)
from retrieval.stores.pgvector.schema import (  # noqa: F401 - list/drop re-exported: the collection API in one place
    HnswParams,
    connect,
    drop_collection,
    ensure_collection,
    find_live,
    get_collection,
    list_collections,
    mask_dsn,
    migrate,
)
from retrieval.stores.pgvector.session import PgSession

log = logging.getLogger(__name__)


_json_dumps = partial(json.dumps, sort_keys=True, default=str)


# At or below this many readable chunks, search exactly (as retrieval.vectors.faiss_ann does, at
# its 16,384). Measured at 1M chunks (docs/benchmarks.md, 2026-12-07): a principal reading 10,000
# got recall@10 0.82-0.84 from the iterative graph scan at any ef_search, and 1.000 at 18.6 ms p50 /
# 35.6 ms p99 from the exact path; with the count cached per token set the check is nearly free.
EXACT_BELOW = 16_384
# HNSW candidate list of a search. At 1M chunks (docs/benchmarks.md, 2026-12-07), with a graph of
# m 16, ef_construction 64, ef_search 100 gave recall@10 0.75 for principals reading 50% / 10%,
# 400 gave 0.92, for 4.1 -> 6.2 ms p50 and 11 -> 19 ms p99; with the store's graph now
# (ef_construction 128, schema.HnswParams) 100 gave 0.946 / 0.957, 200 and 400 0.996 / 0.995, p99
# about 20 ms.
EF_SEARCH = 400
# How long a token set's "at most EXACT_BELOW readable" answer is reused, and how many are kept.
READABLE_TTL_S = 30.0
READABLE_CACHE_SIZE = 4096


def chunk_id(collection: str, document_key: str, index: int) -> int:
    """Deterministic 63-bit chunk id, so re-writing a document is idempotent and ids are stable.

    63 bits keep ids positive int64 (Faiss pads with -1). A collision, about n^2 / 2^64 likely,
    would surface as a primary-key error on write, never as one chunk silently replacing another.
    """
    digest = hashlib.blake2b(f"{collection}\0{document_key}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class PgvectorCollection:
    """One collection in PostgreSQL; implements `retrieval.base.CollectionStore`.

    One connection per instance, used by one thread at a time (a lock), reconnected after the
    server dropped it. Prefer `create_collection` / `open_collection` over the constructor.
    """

    notice: str | None = None  # a plain collection, not a rebuild (see retrieval.base.CollectionStore)

    def __init__(self, dsn: str, info: CollectionInfo, ef_search: int = EF_SEARCH,
                 max_scan_tuples: int = 20_000, exact_below: int = EXACT_BELOW, follow_live: bool = True,
                 durable_commits: bool = False, batch_documents: int = 1,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, index_memory_mb: int = DEFAULT_INDEX_MEMORY_MB,
                 hnsw_m: int = HnswParams.m, hnsw_ef_construction: int = HnswParams.ef_construction) -> None:
        """
        Args:
            dsn: libpq connection string or URL of a migrated database.
            info: the collection's stored description.
            ef_search: HNSW candidate list size (raised to k when k is larger; at most 1000).
            max_scan_tuples: how far an iterative scan digs for chunks that pass the ACL filter
                before falling back to an exact search.
            exact_below: principals who may read at most this many chunks are searched exactly.
            follow_live: follow a switch to a new generation of the collection (see refresh).
            durable_commits: wait for each write's WAL flush (synchronous_commit on); off by
                default: ingest is idempotent and resumable, so a crash's lost tail is redone.
            batch_documents, batch_bytes: documents are written a batch per transaction, once this
                many are buffered or their text and vectors reach this many bytes. 1 (the default
                here: each write is committed, visible to everyone, when it returns) is a
                transaction per document; ingest opens its store with `bulk.DEFAULT_BATCH_DOCUMENTS`
                (`rebuild.open_for_ingest`), and the buffered writes of a batch are committed
                when it is full, at this store's next read, and by `flush`, `save` and `close`.
            index_memory_mb: the most `maintenance_work_mem` an HNSW build after a bulk load asks for.
            hnsw_m, hnsw_ef_construction: the graph parameters of an HNSW index this store builds
                (after a bulk load of a new collection or version; `schema.HnswParams`). An
                index that exists keeps the values it was built with.

        Raises:
            ConfigError: a value out of its range.
        """
        if not 1 <= ef_search <= 1000 or max_scan_tuples < 1:
            raise ConfigError(
                f"ef_search must be 1..1000 and max_scan_tuples >= 1 (got {ef_search}, {max_scan_tuples})")
        if batch_documents < 1 or batch_bytes < 1 or index_memory_mb < 64:
            raise ConfigError(f"batch_documents and batch_bytes must be >= 1 and index_memory_mb >= 64 (got "
                              f"{batch_documents}, {batch_bytes}, {index_memory_mb})")
        self.hnsw = hnsw_params(hnsw_m, hnsw_ef_construction)
        self.dsn = dsn
        # A collection opened as the live one follows a switch to a new generation (refresh);
        # one opened as a build (pg_rebuild) stays on its generation.
        self.follow_live = follow_live
        self.durable_commits = durable_commits
        self.ef_search = ef_search
        self.max_scan_tuples = max_scan_tuples
        self.exact_below = exact_below
        self.num_fallbacks = 0  # approximate searches that found < k and ran exactly instead
        # Whether a token set reads at most exact_below chunks, per token set, for READABLE_TTL_S:
        # the COUNT behind it took 22-80 ms a query at 1M chunks (most of a search's time). A stale
        # answer only picks the other path; both filter by the ACL, and the approximate one falls
        # back to exact search when it finds fewer than k. Cleared by this object's own writes.
        self._readable_cache: dict[tuple[str, ...], tuple[float, bool]] = {}
        self._readable_lock = threading.Lock()
        self._session = PgSession(dsn, lambda: self.name, ef_search, max_scan_tuples, durable_commits)
        self._pending = WriteBuffer(batch_documents, batch_bytes)
        self.index_memory_mb = index_memory_mb
        self._bind(info)

    def _bind(self, info: CollectionInfo) -> None:
        self.info = info
        self._forget_readable_counts()
        self._load = IndexLoad(info.name, info.dim, self.index_memory_mb, self.hnsw)
        self._literal = sql.Literal(info.name)  # the partial index matches only a literal predicate
        self._sql_approx = self._search_sql(exact=False)
        self._sql_exact = self._search_sql(exact=True)

    @property
    def name(self) -> str:
        """The collection's name as users know it (without the generation)."""
        return public_name(self.info)

    @property
    def physical(self) -> str:
        """The generation's own key in the tables: the name, or `name@G` for a later generation."""
        return self.info.name

    def close(self) -> None:
        """Commit buffered writes, then close the connection (also when the commit fails)."""
        try:
            self.flush()
        finally:
            self._session.close()

    def _connection(self) -> psycopg.Connection:
        """The session's connection (tests inspect its settings)."""
        return self._session.connection()

    def __enter__(self) -> PgvectorCollection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def finish(self) -> None:
        """Nothing to switch: this generation is what it is (a rebuild is `PgvectorBuild`)."""
        self.save()
        return None

    # -- writes: a batch of documents per transaction ------------------------------------

    def replace_documents(self, writes: Sequence[DocumentWrite]) -> None:
        """One `replace_document` each: they join the write buffer, which commits many documents together."""
        for w in writes:
            self.replace_document(*w)

    def replace_document(self, doc: Document, acl: frozenset[str], chunks: Sequence[Chunk],
                         vectors: np.ndarray) -> None:
        """Write a document with its chunks and vectors, replacing any previous version atomically.

        The document joins the write buffer; it is committed with its batch, when the batch is
        full or at the next read, `flush`, `save` or `close`, whole or not at all.

        Raises:
            StoreError: vectors of the wrong shape or not finite, or the database failed while
                committing the batch (each of its documents is then either fully old or fully new;
                retrying is safe).
        """
        vectors = self._check_vectors(doc.key, len(chunks), vectors)
        acl_list = sorted(acl)
        rows = [
            (chunk_id(self.physical, doc.key, c.index), self.physical, doc.key, c.index, _text(c.text),
             _text(c.heading), c.num_tokens, Jsonb(c.metadata, dumps=_json_dumps), acl_list, vec)
            for c, vec in zip(chunks, vectors, strict=True)
        ]
        row = (doc.key, _text(doc.source), _text(doc.title), doc.content_hash, acl_list,
               Jsonb(doc.metadata, dumps=_json_dumps), len(rows))
        nbytes = vectors.nbytes + sum(len(c.text) + len(c.heading or "") + 200 for c in chunks)
        if self._pending.add(PendingDocument(doc.key, row, acl_list, rows, nbytes)):
            self.flush()

    def flush(self) -> None:
        """Commit the buffered documents in one transaction (a no-op when none are buffered).

        Raises:
            StoreError: the database failed; none of the batch was written, and it is dropped
                from the buffer (an ingest run ends; the next one writes those documents again).
        """
        documents = self._pending.take()
        if not documents:
            return
        self._forget_readable_counts()

        def write(conn: psycopg.Connection) -> None:
            self._load.before_write(conn)
            write_documents(conn, self.physical, documents, self._durable, self._add_keyword_domain)

        what = f"writing document {documents[0].key!r}" if len(documents) == 1 else \
            f"writing {len(documents)} documents ({documents[0].key!r}...)"
        try:
            self._session.write(what, write)
        except StoreError:
            self._load.forget()  # a lost connection took its load lock along
            raise

    def release_thread(self) -> None:
        """Commit the buffered writes (one session serves every thread: nothing is this thread's own)."""
        self.flush()

    def set_acl(self, key: str, acl: frozenset[str]) -> None:
        """Change a document's ACL (and its chunks' copies) without touching vectors.

        Raises:
            NotFoundError: no such document in this collection.
        """
        self.flush()
        acl_list = sorted(acl)

        def write(conn: psycopg.Connection) -> None:
            self._durable(conn)
            found = conn.execute(
                "UPDATE rag_documents SET acl = %s, updated_at = now() WHERE collection = %s AND key = %s"
                " RETURNING id",
                (acl_list, self.physical, key),
            ).fetchone()
            if found is None:
                raise NotFoundError(f"no document {key!r} in collection {self.name!r}; ingest it first")
            conn.execute("UPDATE rag_chunks SET acl = %s WHERE collection = %s AND document_key = %s",
                         (acl_list, self.physical, key))
            self._add_keyword_domain(conn, acl_list)

        self._session.write(f"changing the ACL of {key!r}", write)
        self._forget_readable_counts()

    def delete_document(self, key: str) -> None:
        """Delete a document and (by cascade) its chunks; an unknown key is a no-op."""
        self.flush()

        def write(conn: psycopg.Connection) -> None:
            self._durable(conn)
            conn.execute("DELETE FROM rag_documents WHERE collection = %s AND key = %s", (self.physical, key))

        self._session.write(f"deleting document {key!r}", write)
        self._forget_readable_counts()

    def _add_keyword_domain(self, conn: psycopg.Connection, acl_list: list[str]) -> None:
        """Record that chunks with this ACL exist, so keyword searches look up its `tag:word` keys."""
        conn.execute("INSERT INTO rag_keyword_domains (collection, acl, tag)"
                     " VALUES (%(name)s, %(acl)s, rag_keyword_domain(%(name)s, %(acl)s)) ON CONFLICT DO NOTHING",
                     {"name": self.physical, "acl": acl_list})

    def _durable(self, conn: psycopg.Connection) -> None:
        """Make the current transaction's commit wait for its WAL flush (a revocation must survive a crash)."""
        if not self.durable_commits:
            conn.execute("SET LOCAL synchronous_commit = on")

    def save(self) -> None:
        """Commit buffered writes; after a bulk load, the last loader to save builds the indexes."""
        self.flush()
        self.end_load(wait=False)

    def end_load(self, wait: bool) -> bool:
        """Leave a bulk load of this generation (`bulk.IndexLoad`) and build its indexes if no one else loads.

        Args:
            wait: wait for other loaders to end theirs, then build the indexes that are missing.

        Returns:
            Whether the indexes exist now (False: another loader builds them when it ends).
        """
        self.flush()
        built: list[bool] = []
        self._session.write(f"building the keyword and HNSW indexes of version {self.info.generation}",
                            lambda conn: built.append(self._load.end(conn, wait, lambda: connect(self.dsn))))
        return built[0]

    def refresh(self) -> bool:
        """Follow a switch to a new generation (a rebuild by any process); True when it moved.

        Nothing else to reload: every query reads the database's current state.
        """
        if not self.follow_live:
            return False
        self.flush()  # buffered rows belong to the generation they were written for
        live = self._session.read("finding the live version", lambda conn: find_live(conn, self.name))
        if live is None:
            raise NotFoundError(f"collection {self.name!r} was dropped from {mask_dsn(self.dsn)}")
        if live.name == self.physical:
            return False
        log.info("collection %r: now reading version %d", self.name, live.generation)
        self._bind(live)
        return True

    # -- reads ---------------------------------------------------------------------------

    def document_states(self) -> dict[str, DocumentState]:
        self.flush()
        rows = self._session.read("reading document states", lambda conn: conn.execute(
            "SELECT id, key, content_hash, acl, num_chunks FROM rag_documents WHERE collection = %s",
            (self.physical,),
        ).fetchall())
        return {r[1]: DocumentState(r[0], r[1], r[2], frozenset(r[3]), r[4]) for r in rows}

    def stats(self) -> dict[str, int]:
        """{"documents": n, "chunks": n}."""
        self.flush()
        docs, chunks = self._session.read("counting documents", lambda conn: conn.execute(
            "SELECT count(*), coalesce(sum(num_chunks), 0) FROM rag_documents WHERE collection = %s",
            (self.physical,),
        ).fetchone())
        return {"documents": int(docs), "chunks": int(chunks)}

    def search(self, query: np.ndarray, k: int, tokens: Sequence[str],
               exact: bool = False) -> list[tuple[int, float]]:
        """Dense top-k (chunk id, inner product) among chunks `tokens` may read, best first.

        Approximate searches use the collection's HNSW index with an iterative scan; when that
        finds fewer than k readable chunks (a very selective ACL), the exact search runs instead,
        so the answer has k hits whenever k are readable.

        Raises:
            StoreError: the query has the wrong dimension, or the database failed.
        """
        query = np.asarray(query, dtype=np.float32).reshape(-1)
        if query.shape[0] != self.info.dim:
            raise StoreError(
                f"query vector has {query.shape[0]} dims but collection {self.name!r} has {self.info.dim}: "
                f"embed queries with the collection's embedder ({self.info.embedder})"
            )
        self.flush()
        tokens = sorted(set(tokens))
        if not tokens or k <= 0:
            return []
        params = {"q": query, "tokens": tokens, "k": k}

        def run(conn: psycopg.Connection) -> list[tuple[int, float]]:
            # A selective ACL (few readable chunks) is answered exactly from the ACL's GIN index:
            # exact, and cheaper than an iterative graph scan digging for rare readable rows.
            if not exact and self.exact_below > 0 and self._readable_at_most(conn, tokens, self.exact_below):
                return self._exact(conn, params)
            if not exact:
                # The session already scans iteratively (see _connection); one round trip.
                if k <= self.ef_search:
                    rows = conn.execute(self._sql_approx, params).fetchall()
                else:
                    with conn.transaction():
                        conn.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(min(1000, k))))
                        rows = conn.execute(self._sql_approx, params).fetchall()
                if len(rows) == k:
                    return rows
                self.num_fallbacks += 1
            return self._exact(conn, params)

        return [(int(i), float(s)) for i, s in self._session.read("searching", run)]

    def _exact(self, conn: psycopg.Connection, params: dict) -> list[tuple[int, float]]:
        with conn.transaction():
            # Exhaustive: without index scans the plan is a (bitmap or sequential) scan + sort.
            conn.execute("SET LOCAL enable_indexscan = off")
            return conn.execute(self._sql_exact, params).fetchall()

    def _readable_at_most(self, conn: psycopg.Connection, tokens: list[str], limit: int) -> bool:
        """Whether at most `limit` chunks are readable with `tokens` (counting stops past it; cached)."""
        key, now = tuple(tokens), time.monotonic()
        with self._readable_lock:
            hit = self._readable_cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        few = self._count_readable(conn, tokens, limit + 1) <= limit
        with self._readable_lock:
            if len(self._readable_cache) >= READABLE_CACHE_SIZE:
                self._readable_cache.clear()  # many distinct token sets: start again rather than track age
            self._readable_cache[key] = (now + READABLE_TTL_S, few)
        return few

    def _count_readable(self, conn: psycopg.Connection, tokens: list[str], stop: int) -> int:
        """How many chunks `tokens` may read, counting no further than `stop`."""
        row = conn.execute(sql.SQL(
            "SELECT COUNT(*) FROM (SELECT 1 FROM rag_chunks WHERE collection = {name}"
            " AND acl && %(tokens)s::text[] LIMIT %(limit)s) AS readable").format(name=self._literal),
            {"tokens": tokens, "limit": stop}).fetchone()
        return int(row[0])

    def _forget_readable_counts(self) -> None:
        with self._readable_lock:
            self._readable_cache.clear()

    def search_plan(self, query: np.ndarray, k: int, tokens: Sequence[str]) -> str:
        """EXPLAIN ANALYZE of the approximate search (which index ran, how many rows it visited)."""
        self.flush()
        params = {"q": np.asarray(query, dtype=np.float32).reshape(-1), "tokens": sorted(set(tokens)), "k": k}
        statement = sql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + self._sql_approx
        rows = self._session.read("explaining a search", lambda conn: conn.execute(statement, params).fetchall())
        return "\n".join(r[0] for r in rows)

    def keyword_search(self, text: str, k: int, tokens: Sequence[str]) -> list[tuple[int, float]]:
        """Full-text top-k (chunk id, ts_rank_cd) among readable chunks that contain any query term.

        Terms come from `keyword.query_terms` (the same words the SQLite side searches); each one
        goes through `phraseto_tsquery` as a value, never as tsquery syntax, so `E-VCF-017` is
        the phrase "e-vcf e vcf 017" as the documents' parser splits it, and the terms are OR-ed.
        Candidates come from the collection's keyword index by `tag:word` keys of the readable
        ACL domains only (migrations 3 and 5), so the work done never depends on chunks the
        principal may not read.
        """
        self.flush()
        statement, params = self._keyword_sql(text, k, tokens)
        if statement is None:
            return []
        rows = self._session.read("keyword search", lambda conn: conn.execute(statement, params).fetchall())
        return [(int(i), float(s)) for i, s in rows]

    def keyword_plan(self, text: str, k: int, tokens: Sequence[str]) -> dict | None:
        """EXPLAIN (ANALYZE, BUFFERS) of a keyword search as JSON: the work it did (rows, pages)."""
        self.flush()
        statement, params = self._keyword_sql(text, k, tokens)
        if statement is None:
            return None

        explain = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON) ") + statement
        return self._session.read("explaining a keyword search",
                                  lambda conn: conn.execute(explain, params).fetchone()[0][0])

    def _keyword_sql(self, text: str, k: int, tokens: Sequence[str]) -> tuple[sql.Composed | None, dict]:
        terms = query_terms(_text(text))
        tokens = sorted(set(tokens))
        if not terms or not tokens or k <= 0:
            return None, {}
        params: dict[str, object] = {"name": self.physical, "tokens": tokens, "k": k, "terms": terms}
        params.update({f"t{n}": t for n, t in enumerate(terms)})
        tsquery = sql.SQL(" || ").join(
            sql.SQL("phraseto_tsquery('english', {})").format(sql.Placeholder(f"t{n}")) for n in range(len(terms)))
        # keys: `tag:lexeme` for every readable domain and every lexeme of the terms (a phrase's
        # words each; `tsv @@` below then checks the phrase itself). Candidates come from
        # rag_keyword_candidates (the keyword index only, see migration 5), materialized so that no
        # other condition reaches rag_chunks. Scalar subqueries are computed once (InitPlans).
        # Weights {D, C, B, A}: a term in the heading (A) counts twice one in the text (B).
        statement = sql.SQL(
            "WITH keys AS (SELECT array_agg(d.tag || ':' || l.lexeme) AS k FROM rag_keyword_domains d,"
            " unnest(%(terms)s::text[]) AS t(term), unnest(to_tsvector('english', t.term)) AS l"
            " WHERE d.collection = %(name)s AND d.acl && %(tokens)s::text[]),"
            " candidates AS MATERIALIZED (SELECT * FROM"
            " rag_keyword_candidates(%(name)s, %(tokens)s::text[], (SELECT k FROM keys)))"
            " SELECT id, ts_rank_cd('{{0, 0, 0.5, 1}}', tsv, (SELECT {tsq})) AS score FROM candidates"
            " WHERE collection = %(name)s AND acl && %(tokens)s::text[] AND tsv @@ (SELECT {tsq})"
            " ORDER BY score DESC, id LIMIT %(k)s"
        ).format(tsq=tsquery)
        return statement, params

    def chunk_records(self, ids: Sequence[int]) -> dict[int, ChunkRecord]:
        """Chunks of this collection by id, with their document's key, source, title and ACL."""
        self.flush()
        ids = [int(i) for i in ids]
        if not ids:
            return {}
        rows = self._session.read("reading chunks", lambda conn: conn.execute(
            "SELECT c.id, d.key, d.source, d.title, c.idx, c.text, c.heading, d.acl"
            " FROM rag_chunks c JOIN rag_documents d ON d.collection = c.collection AND d.key = c.document_key"
            " WHERE c.collection = %s AND c.id = ANY(%s::bigint[])",
            (self.physical, ids),
        ).fetchall())
        return {r[0]: ChunkRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], frozenset(r[7])) for r in rows}

    def dump(self) -> list[dict]:
        """Canonical id-free rows (key, hash, acl, title, index, text, heading, vector), like the catalog's."""
        self.flush()
        rows = self._session.read("dumping the collection", lambda conn: conn.execute(
            # COLLATE "C": byte order, as SQLite sorts, whatever the database's collation.
            "SELECT d.key, d.content_hash, d.acl, d.title, c.idx, c.text, c.heading, c.embedding"
            " FROM rag_documents d LEFT JOIN rag_chunks c ON c.collection = d.collection AND c.document_key = d.key"
            ' WHERE d.collection = %s ORDER BY d.key COLLATE "C", c.idx',
            (self.physical,),
        ).fetchall())
        return [
            {"key": r[0], "hash": r[1], "acl": list(r[2]), "title": r[3], "index": r[4], "text": r[5],
             "heading": r[6], "vector": None if r[7] is None else r[7].to_numpy().astype(np.float32)}
            for r in rows
        ]

    # -- internals -----------------------------------------------------------------------

    def _search_sql(self, exact: bool) -> sql.Composed:
        # Same expression as the partial index (`embedding::vector(DIM)`) and a literal collection
        # predicate: both are needed for the planner to pick this collection's HNSW index. The
        # inner ORDER BY is the distance alone so the index can serve it; relaxed_order may return
        # slightly out of order, so the outer query sorts, ties by id as the reference store does.
        # The exact search computes the distance on the uncast column, an expression no index
        # orders by: otherwise the planner may read the graph in distance order and only sort ties
        # by id (an incremental sort), which is approximate; it did once sorts were costed high.
        inner_order = sql.SQL("distance, id" if exact else "distance")
        vector = sql.SQL("embedding") if exact else sql.SQL("(embedding::vector({dim}))").format(
            dim=sql.Literal(self.info.dim))
        return sql.SQL(
            "WITH hits AS MATERIALIZED ("
            " SELECT id, {vector} <#> %(q)s::vector AS distance FROM rag_chunks"
            " WHERE collection = {name} AND acl && %(tokens)s::text[] ORDER BY {order} LIMIT %(k)s)"
            " SELECT id, -distance FROM hits ORDER BY distance, id"
        ).format(vector=vector, name=self._literal, order=inner_order)

    def _check_vectors(self, key: str, n: int, vectors: np.ndarray) -> np.ndarray:
        vectors = np.asarray(vectors, dtype=np.float32)
        if n == 0:
            return vectors.reshape(0, self.info.dim)
        if vectors.ndim != 2 or vectors.shape != (n, self.info.dim):
            raise StoreError(
                f"document {key!r} has vectors of shape {vectors.shape} for {n} chunks, but collection "
                f"{self.name!r} stores {self.info.dim}-dim vectors: embed with the collection's embedder "
                f"({self.info.embedder}) or ingest into a new collection"
            )
        if not np.isfinite(vectors).all():
            raise StoreError(f"document {key!r} has NaN or infinite vector values; check the embedder's output")
        return vectors

# -- collections ---------------------------------------------------------------------------


def create_collection(dsn: str, name: str, embedder: str, fingerprint: str, dim: int, chunking: dict,
                      **tuning: int) -> PgvectorCollection:
    """Create a collection (and its HNSW index), or open an existing one built with the same embedder.

    Migrates the database first. `tuning` goes to `PgvectorCollection` (ef_search, max_scan_tuples,
    hnsw_m and hnsw_ef_construction: the graph of a new collection's index).

    Raises:
        StoreError: the server does not answer, or the collection exists with another embedder.
        ConfigError: a tuning value out of its range.
    """
    hnsw = hnsw_params(**tuning)
    migrate(dsn)
    with connect(dsn) as conn:
        live = find_live(conn, name)
    info = live or ensure_collection(dsn, name, embedder, fingerprint, dim, chunking, hnsw=hnsw)
    _check_embedder(info, embedder, fingerprint, dim)
    return PgvectorCollection(dsn, info, **tuning)


def open_collection(dsn: str, name: str, embedder: str | None = None, fingerprint: str | None = None,
                    dim: int | None = None, **tuning: int) -> PgvectorCollection:
    """Open an existing collection; with `fingerprint`/`dim`, check they match what it was built with.

    Raises:
        NotFoundError: no such collection (the message lists those that exist).
        StoreError: the server does not answer, or the embedder does not match.
    """
    migrate(dsn)
    info = get_collection(dsn, name)
    _check_embedder(info, embedder, fingerprint, dim)
    return PgvectorCollection(dsn, info, **tuning)


def hnsw_params(hnsw_m: int = HnswParams.m, hnsw_ef_construction: int = HnswParams.ef_construction,
                **other_tuning: object) -> HnswParams:
    """The graph parameters of a store's `tuning` (`PgvectorCollection`'s keywords), or ConfigError
    saying which value is out of range: for callers that create rows before they open the store."""
    try:
        return HnswParams(hnsw_m, hnsw_ef_construction)
    except ValueError as e:
        raise ConfigError(f"{e}: set pg_hnsw_m / pg_hnsw_ef_construction within pgvector's bounds") from e


def public_name(info: CollectionInfo) -> str:
    """What users call the collection whose generation `info` is."""
    return info.name if info.generation == 1 else info.name.rsplit(GENERATION_SEP, 1)[0]


def _check_embedder(info: CollectionInfo, embedder: str | None, fingerprint: str | None, dim: int | None) -> None:
    if (fingerprint is None or fingerprint == info.fingerprint) and (dim is None or dim == info.dim):
        return
    raise StoreError(
        f"collection {info.name!r} was built with embedder {info.embedder} ({info.dim} dims, fingerprint "
        f"{info.fingerprint}); this run uses {embedder or 'another embedder'} ({dim or '?'} dims, "
        f"fingerprint {fingerprint}): use the same embedder, ingest into a new collection name, "
        "or drop this collection and re-ingest"
    )


def _text(value: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL; parsers reject such files, this covers other sources.
    return None if value is None else value.replace("\0", "\ufffd")
