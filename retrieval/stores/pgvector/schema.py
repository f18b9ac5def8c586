"""PostgreSQL layout of the pgvector store: versioned migrations, collections and their indexes.

Every process that opens a store calls `migrate(dsn)`; the fast path is one read of
`rag_schema_version`, and only a database that is behind takes the lock, so parallel ingest
shards starting at once apply each migration exactly once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from rag.errors import NotFoundError, StoreError, StoreUnavailable
from retrieval.records import GENERATION_SEP, CollectionInfo, generation_name
from retrieval.stores.pgvector.migrations import MigrationSet
from retrieval.stores.pgvector.migrations import migrate as run_migrations

# Iterative index scans (`hnsw.iterative_scan`) arrived in pgvector 0.8.0: without them a
# selective ACL filter could leave fewer than k hits after the index's ef_search candidates.
MIN_PGVECTOR = (0, 8, 0)

# pgvector's HNSW indexes `vector` up to 2,000 dimensions; wider collections are searched
# exhaustively (still correct, just slower).
MAX_HNSW_DIM = 2000

# pgvector's bounds for an HNSW index's `m` and `ef_construction` (it refuses others).
HNSW_M_RANGE = (2, 100)
HNSW_EF_CONSTRUCTION_RANGE = (4, 1000)


@dataclass(frozen=True)
class HnswParams:
    """How a collection's HNSW graph is built (pgvector's index options).

    `m`: links a node keeps on each upper layer (2m on the bottom one); `ef_construction`: the
    candidate list each insert searches for its neighbours, at least 2m (pgvector refuses less).
    Both make a better graph (recall at a given `hnsw.ef_search`) for a slower build and, for
    `m`, a larger index. They are options of the CREATE INDEX statement only: an index keeps
    the values it was built with (stored in its `reloptions`), and an index built later (a new
    collection, the next version of a rebuild) takes the values asked for then.

    The defaults: m 16 (pgvector's), ef_construction 128 (pgvector's is 64). At 1M clustered
    384-d chunks (bench/filtered_search.py, docs/benchmarks.md, 2026-12-07) ef_construction 64
    gave recall@10 0.92 at ef_search 400 for principals reading 50% / 10%, and no more than
    0.94 at any ef_search (the graph, not the search, was short); 96 gave 0.977 / 0.972, 128
    gave 0.996 / 0.995, with p99 about 20 ms either way and the index no larger (its size is m's).
    The price is the build: about 2.2x pgvector's default graph at 80k-200k vectors on 2 cores
    (bench/pgvector_graph_build.py), so a bulk load ends later.
    """

    m: int = 16
    ef_construction: int = 128

    def __post_init__(self) -> None:
        lo_m, hi_m = HNSW_M_RANGE
        lo_ef, hi_ef = HNSW_EF_CONSTRUCTION_RANGE
        for name, value, lo, hi in (("m", self.m, lo_m, hi_m), ("ef_construction", self.ef_construction, lo_ef, hi_ef)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"HNSW {name} must be a whole number from {lo} to {hi}, got {value!r}")
        if self.ef_construction < 2 * self.m:
            raise ValueError(f"HNSW ef_construction must be at least 2 x m = {2 * self.m} "
                             f"(got m {self.m}, ef_construction {self.ef_construction})")


# Any constant unique to this project; pg_advisory_lock keys are one bigint.
_MIGRATION_LOCK = 0x7261675F736368  # "rag_sch"

# Design of rag_chunks.embedding: one untyped `vector` column, and per collection a partial
# expression HNSW index `((embedding::vector(DIM)) vector_ip_ops) WHERE collection = 'NAME'`
# (created with the collection, see pgvector.py). Why this rather than a table per dimension:
# every collection gets its own HNSW graph, so a search walks only that collection's vectors
# (with one shared index, the collection filter would be one more selective filter for the
# iterative scan to dig through), collections of any dimension share one schema, and dropping
# a collection drops its index. Inner product ops because vectors are L2-normalised and the
# stores report the inner product as the score.
MIGRATIONS: list[tuple[int, str]] = [
    (1, """
CREATE TABLE rag_collections (
    name        text PRIMARY KEY,
    embedder    text NOT NULL,
    fingerprint text NOT NULL,
    dim         integer NOT NULL CHECK (dim > 0),
    chunking    jsonb NOT NULL,
    metric      text NOT NULL DEFAULT 'ip',
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE rag_documents (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    collection   text NOT NULL REFERENCES rag_collections(name) ON DELETE CASCADE,
    key          text NOT NULL,
    source       text NOT NULL,
    title        text,
    content_hash text NOT NULL,
    acl          text[] NOT NULL,
    metadata     jsonb NOT NULL,
    num_chunks   integer NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (collection, key)
);
CREATE TABLE rag_chunks (
    id           bigint PRIMARY KEY,
    collection   text NOT NULL,
    document_key text NOT NULL,
    idx          integer NOT NULL,
    text         text NOT NULL,
    heading      text,
    num_tokens   integer NOT NULL,
    metadata     jsonb NOT NULL,
    -- A copy of the document's ACL, so the filter is a condition of the index scan itself.
    acl          text[] NOT NULL,
    -- Keyword index over heading (weight A) and text (B), as the SQLite FTS5 side indexes both.
    tsv          tsvector GENERATED ALWAYS AS (
        setweight(to_tsvector('english', coalesce(heading, '')), 'A') || setweight(to_tsvector('english', text), 'B')
    ) STORED,
    embedding    vector NOT NULL,
    UNIQUE (collection, document_key, idx),
    FOREIGN KEY (collection, document_key) REFERENCES rag_documents(collection, key)
        ON DELETE CASCADE
);
CREATE INDEX rag_chunks_acl ON rag_chunks USING gin (acl);
CREATE INDEX rag_chunks_tsv ON rag_chunks USING gin (tsv);
"""),
    # Generations: a change of embedder or chunking builds the collection again beside the live
    # one, as the row `NAME@G` (generation G, not live), and a one-row flip of `live` switches
    # queries over once it is complete (retrieval/stores/pgvector/rebuild.py). `name` stays the
    # physical key every chunk row, chunk id and partial HNSW index uses; `public_name` is what
    # users call the collection, and at most one of its generations is live.
    (2, """
ALTER TABLE rag_collections ADD COLUMN public_name text;
UPDATE rag_collections SET public_name = name;
ALTER TABLE rag_collections ALTER COLUMN public_name SET NOT NULL;
ALTER TABLE rag_collections ADD COLUMN generation integer NOT NULL DEFAULT 1 CHECK (generation >= 1);
ALTER TABLE rag_collections ADD COLUMN live boolean NOT NULL DEFAULT true;
CREATE UNIQUE INDEX rag_collections_live ON rag_collections (public_name) WHERE live;
"""),
    # Keyword search by ACL domain (issue 13): the GIN index on `tsv` kept one posting list per
    # word over every chunk, so a search read (and spent time on) the postings of chunks the
    # caller may not read. `kw` holds each word of a chunk prefixed with its domain's tag (a
    # hash of collection and ACL), so a search looks up only `tag:word` keys of readable
    # domains, and `tsv` is only evaluated on those candidates. fastupdate off: a GIN pending
    # list is scanned whole by every search, whatever ACL its entries have.
    (3, """
CREATE FUNCTION rag_keyword_domain(collection text, acl text[]) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT left(md5(collection || chr(31) || array_to_string(acl, chr(31))), 16) $$;
CREATE FUNCTION rag_keyword_keys(collection text, acl text[], heading text, body text) RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT coalesce(array_agg(rag_keyword_domain(collection, acl) || ':' || l.lexeme), '{}')
          FROM unnest(to_tsvector('english', coalesce(heading, '')) || to_tsvector('english', body)) AS l $$;
ALTER TABLE rag_chunks ADD COLUMN kw text[]
    GENERATED ALWAYS AS (rag_keyword_keys(collection, acl, heading, text)) STORED;
CREATE TABLE rag_keyword_domains (
    collection text NOT NULL REFERENCES rag_collections(name) ON DELETE CASCADE,
    acl        text[] NOT NULL,
    tag        text NOT NULL,
    PRIMARY KEY (collection, acl)
);
INSERT INTO rag_keyword_domains (collection, acl, tag)
    SELECT DISTINCT collection, acl, rag_keyword_domain(collection, acl) FROM rag_chunks;
CREATE INDEX rag_chunks_kw ON rag_chunks USING gin (kw) WITH (fastupdate = off);
-- The chunks holding any of `keys`, read through rag_chunks_kw only: the SET clause keeps the
-- planner from scanning the whole table instead (which would read every chunk), without a
-- transaction round trip per search for SET LOCAL.
CREATE FUNCTION rag_keyword_candidates(keys text[]) RETURNS TABLE (id bigint, collection text, acl text[], tsv tsvector)
    LANGUAGE sql STABLE PARALLEL SAFE SET enable_seqscan = off
    AS $$ SELECT c.id, c.collection, c.acl, c.tsv FROM rag_chunks c WHERE c.kw && keys $$;
DROP INDEX rag_chunks_tsv;
ALTER INDEX rag_chunks_acl SET (fastupdate = off);
SELECT gin_clean_pending_list('rag_chunks_acl');
"""),
    # Bulk writes (issue 33): the keyword keys of a chunk in PL/pgSQL, the domain's tag hashed
    # once per chunk instead of once per word; the same keys in the same order, so the stored
    # `kw` values stay valid. It was a third of the time a chunk's insert took.
    (4, """
CREATE OR REPLACE FUNCTION rag_keyword_keys(collection text, acl text[], heading text, body text) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    AS $$
DECLARE
    prefix text := rag_keyword_domain(collection, acl) || ':';
BEGIN
    RETURN ARRAY(SELECT prefix || l.lexeme
                 FROM unnest(to_tsvector('english', coalesce(heading, '')) || to_tsvector('english', body)) AS l);
END $$;
"""),
    # Keyword index per collection (issue 33): one shared GIN index over `kw` took every chunk's
    # ~110 keys one insert at a time (fastupdate off), the largest cost of a bulk load after the
    # HNSW build, and the stored `kw` array (~2.7 kB a chunk) cost as much again to compute,
    # compress and write. Now each generation has a partial GIN expression index
    # `rag_kw_<md5(name)[:16]>` over `rag_chunk_keys(collection, acl, tsv)`: the same `tag:lexeme`
    # keys (tsv's lexemes are kw's), computed when the index is built or maintained and never
    # stored, so a bulk load builds it once at the end, sorted in memory, like the HNSW graph
    # (bulk.IndexLoad). Still fastupdate off (no pending list that every search would scan), and
    # a search now reads only its own collection's index. rag_chunk_keys uses pg_catalog only:
    # index builds (CREATE INDEX, VACUUM FULL) run it with search_path = pg_catalog.
    (5, """
CREATE FUNCTION rag_chunk_keys(collection text, acl text[], tsv tsvector) RETURNS text[]
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
    AS $$
DECLARE
    -- rag_keyword_domain(collection, acl), inlined: see above.
    prefix text := left(md5(collection || chr(31) || array_to_string(acl, chr(31))), 16) || ':';
BEGIN
    RETURN ARRAY(SELECT prefix || l.lexeme FROM unnest(tsv) AS l);
END $$;
DROP FUNCTION rag_keyword_candidates(text[]);
ALTER TABLE rag_chunks DROP COLUMN kw;
DROP FUNCTION rag_keyword_keys(text, text[], text, text);
-- The chunks of collection `coll` holding any of `keys`, read through its keyword index only:
-- a statement planned with the literal name, so the partial index applies, seqscan off as in
-- migration 3, and the index's predicate is `(collection || '') = NAME` rather than
-- `collection = NAME`, so that the B-tree on (collection, ...) cannot serve it (the planner
-- took it, then computed the keys of every chunk of the collection, readable or not). While a
-- bulk load has not built the index yet, only chunks `tokens` may read get their keys computed
-- (read through the ACL index; any plan runs the cheap ACL condition before the function).
CREATE FUNCTION rag_keyword_candidates(coll text, tokens text[], keys text[])
    RETURNS TABLE (id bigint, collection text, acl text[], tsv tsvector)
    LANGUAGE plpgsql STABLE PARALLEL SAFE SET enable_seqscan = off
    AS $$
#variable_conflict use_column
BEGIN
    IF to_regclass('rag_kw_' || left(md5(coll), 16)) IS NOT NULL THEN
        RETURN QUERY EXECUTE format('SELECT c.id, c.collection, c.acl, c.tsv FROM rag_chunks c'
            ' WHERE (c.collection || '''') = %L AND rag_chunk_keys(c.collection, c.acl, c.tsv) && $1', coll)
            USING keys;
    ELSE
        RETURN QUERY SELECT c.id, c.collection, c.acl, c.tsv FROM rag_chunks c
            WHERE c.collection = coll AND c.acl && tokens AND rag_chunk_keys(c.collection, c.acl, c.tsv) && keys;
    END IF;
END $$;
DO $$
DECLARE
    coll text;
BEGIN
    FOR coll IN SELECT name FROM rag_collections ORDER BY name LOOP
        EXECUTE format('CREATE INDEX %I ON rag_chunks USING gin (rag_chunk_keys(collection, acl, tsv))'
                       ' WITH (fastupdate = off) WHERE (collection || '''') = %L',
                       'rag_kw_' || left(md5(coll), 16), coll);
    END LOOP;
END $$;
"""),
]

LATEST = MIGRATIONS[-1][0]
SCHEMA_STEPS = MigrationSet(MIGRATIONS, "rag_schema_version", _MIGRATION_LOCK, "the rag schema")

_json_dumps = partial(json.dumps, sort_keys=True, default=str)


def migrate(dsn: str) -> int:
    """Bring the database at `dsn` to the latest schema; safe to call from many processes at once.

    Returns:
        The schema version now in the database.

    Raises:
        StoreError: the server does not answer, pgvector is missing or older than 0.8, or the
            database was migrated by a newer version of this project.
    """
    with connect(dsn, autocommit=True) as conn:
        return run_migrations(conn, SCHEMA_STEPS, mask_dsn(dsn), before=lambda c: ensure_pgvector(c, dsn))


def ensure_collection(dsn: str, name: str, embedder: str, fingerprint: str, dim: int,
                      chunking: dict, generation: int = 1, build_index: bool = True,
                      hnsw: HnswParams = HnswParams()) -> CollectionInfo:
    """Create a collection with its HNSW index unless it exists; return what is stored (migrated `dsn`).

    Generation 1 is created live under its own name; a later generation G is created hidden, as
    `name@G`, for `pg_rebuild` to fill and switch to. Concurrent callers are safe: the loser of
    the insert race waits for the winner's commit. With `build_index` False the collection starts
    without its keyword and HNSW indexes, for a bulk load that builds them at the end (`bulk.IndexLoad`);
    otherwise its HNSW index is built with `hnsw` (an existing collection keeps the index it has).
    """
    if not name or dim <= 0 or GENERATION_SEP in name:
        raise StoreError(f"a collection needs a name without {GENERATION_SEP!r} and a positive dimension "
                         f"(got {name!r}, {dim})")
    physical = name if generation == 1 else generation_name(name, generation)
    with admin_connection(dsn, f"creating collection {name!r}") as conn, conn.transaction():
        created = conn.execute(
            "INSERT INTO rag_collections (name, public_name, generation, live, embedder, fingerprint, dim,"
            " chunking, metric) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'ip') ON CONFLICT DO NOTHING RETURNING name",
            (physical, name, generation, generation == 1, embedder, fingerprint, dim,
             Jsonb(chunking, dumps=_json_dumps)),
        ).fetchone()
        if created and build_index:
            # In the creating transaction, so such a collection never exists without its indexes.
            create_keyword_index(conn, physical)
            if dim <= MAX_HNSW_DIM:
                create_hnsw_index(conn, physical, dim, hnsw)
    return _info(dsn, physical)


def create_hnsw_index(conn: psycopg.Connection, physical: str, dim: int, hnsw: HnswParams) -> None:
    """Build generation `physical`'s partial HNSW index with `hnsw` (in the caller's transaction).

    The build scans rag_chunks and blocks its writers (of every collection) meanwhile: instant
    on an empty collection, and after a bulk load it runs once, with the graph in memory.
    """
    conn.execute(sql.SQL(
        "CREATE INDEX IF NOT EXISTS {index} ON rag_chunks USING hnsw ((embedding::vector({dim})) vector_ip_ops)"
        " WITH (m = {m}, ef_construction = {ef}) WHERE collection = {name}"
    ).format(index=sql.Identifier(hnsw_index_name(physical)), dim=sql.Literal(dim), m=sql.Literal(hnsw.m),
             ef=sql.Literal(hnsw.ef_construction), name=sql.Literal(physical)))


def hnsw_index_options(conn: psycopg.Connection, physical: str) -> HnswParams | None:
    """The `m` and `ef_construction` generation `physical`'s HNSW index was built with (None: no index).

    An index created without options (by this store before they were settings) has pgvector's
    defaults, 16 and 64.
    """
    row = conn.execute("SELECT c.reloptions FROM pg_class c WHERE c.oid = to_regclass(%s)",
                       (sql.Identifier(hnsw_index_name(physical)).as_string(conn),)).fetchone()
    if row is None:
        return None
    options = dict(o.split("=", 1) for o in row[0] or [])
    return HnswParams(int(options.get("m", 16)), int(options.get("ef_construction", 64)))


def create_keyword_index(conn: psycopg.Connection, physical: str) -> None:
    """Build generation `physical`'s keyword index (migration 5), in the caller's transaction.

    Built after a bulk load, it sorts every chunk's keys in memory (`maintenance_work_mem`) and
    writes each posting list once, instead of ~110 index inserts a chunk.
    """
    conn.execute(sql.SQL(
        "CREATE INDEX IF NOT EXISTS {index} ON rag_chunks USING gin (rag_chunk_keys(collection, acl, tsv))"
        # `|| ''`: see rag_keyword_candidates (migration 5).
        " WITH (fastupdate = off) WHERE (collection || '') = {name}"
    ).format(index=sql.Identifier(keyword_index_name(physical)), name=sql.Literal(physical)))


def keyword_index_exists(conn: psycopg.Connection, physical: str) -> bool:
    """Whether generation `physical` has its keyword index (a bulk-loaded one has none until its load ends)."""
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                        (sql.Identifier(keyword_index_name(physical)).as_string(conn),)).fetchone()[0]


def hnsw_index_exists(conn: psycopg.Connection, physical: str) -> bool:
    """Whether generation `physical` has its HNSW index (a bulk-loaded one has none until its load ends)."""
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                        (sql.Identifier(hnsw_index_name(physical)).as_string(conn),)).fetchone()[0]


_INFO_COLUMNS = "name, embedder, fingerprint, dim, chunking, generation"


def _info(dsn: str, physical: str) -> CollectionInfo:
    with admin_connection(dsn, f"opening collection {physical!r}") as conn:
        row = conn.execute(f"SELECT {_INFO_COLUMNS} FROM rag_collections WHERE name = %s", (physical,)).fetchone()
    if row is None:
        raise NotFoundError(f"collection {physical!r} vanished from {mask_dsn(dsn)} (dropped meanwhile?)")
    return CollectionInfo(row[0], row[1], row[2], row[3], row[4], 0, row[5])


def find_live(conn: psycopg.Connection, name: str) -> CollectionInfo | None:
    """The live generation of collection `name` (its `name` is the physical one, e.g. `lab@2`), or None."""
    row = conn.execute(
        f"SELECT {_INFO_COLUMNS} FROM rag_collections WHERE public_name = %s AND live", (name,)
    ).fetchone()
    return None if row is None else CollectionInfo(row[0], row[1], row[2], row[3], row[4], 0, row[5])


def get_collection(dsn: str, name: str) -> CollectionInfo:
    """The stored description of collection `name`'s live generation (version is always 0).

    Raises:
        NotFoundError: no such collection; the message lists those that exist.
    """
    with admin_connection(dsn, f"opening collection {name!r}") as conn:
        info = find_live(conn, name)
        names = [] if info else [r[0] for r in conn.execute(
            "SELECT public_name FROM rag_collections WHERE live ORDER BY public_name")]
    if info is None:
        have = ", ".join(names) if names else "none yet; run `rag ingest PATH` first"
        raise NotFoundError(f"unknown collection {name!r} in {mask_dsn(dsn)} (collections: {have})")
    return info


def hidden_generations(dsn: str, name: str) -> list[CollectionInfo]:
    """Generations of collection `name` that do not answer queries (being built, or left to drop)."""
    with admin_connection(dsn, f"reading the versions of collection {name!r}") as conn:
        rows = conn.execute(
            f"SELECT {_INFO_COLUMNS} FROM rag_collections WHERE public_name = %s AND NOT live ORDER BY generation",
            (name,),
        ).fetchall()
    return [CollectionInfo(r[0], r[1], r[2], r[3], r[4], 0, r[5]) for r in rows]


def list_collections(dsn: str) -> dict[str, dict[str, int]]:
    """Every collection's name -> {"documents": n, "chunks": n} of its live generation, by name."""
    migrate(dsn)
    with admin_connection(dsn, "listing collections") as conn:
        rows = conn.execute(
            "SELECT c.public_name, count(d.id), coalesce(sum(d.num_chunks), 0) FROM rag_collections c"
            " LEFT JOIN rag_documents d ON d.collection = c.name WHERE c.live"
            " GROUP BY c.public_name ORDER BY c.public_name"
        ).fetchall()
    return {r[0]: {"documents": int(r[1]), "chunks": int(r[2])} for r in rows}


def drop_collection(dsn: str, name: str) -> None:
    """Delete a collection (every generation), its documents, chunks and indexes; an unknown name is a no-op."""
    migrate(dsn)
    with admin_connection(dsn, f"dropping collection {name!r}") as conn:
        physical = [r[0] for r in conn.execute(
            "SELECT name FROM rag_collections WHERE public_name = %s OR name = %s", (name, name))]
    for p in physical:
        drop_generation(dsn, p)


def drop_generation(dsn: str, physical: str) -> int:
    """Delete one generation (physical name) with its documents, chunks and indexes; returns documents deleted."""
    with admin_connection(dsn, f"dropping collection {physical!r}") as conn, conn.transaction():
        deleted = conn.execute("SELECT count(*) FROM rag_documents WHERE collection = %s", (physical,)).fetchone()[0]
        conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(hnsw_index_name(physical))))
        conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(keyword_index_name(physical))))
        conn.execute("DELETE FROM rag_collections WHERE name = %s", (physical,))
    return int(deleted)


def hnsw_index_name(collection: str) -> str:
    # Collection names are free text and identifiers stop at 63 bytes: name the index by a hash.
    return "rag_hnsw_" + hashlib.blake2b(collection.encode(), digest_size=8).hexdigest()


def keyword_index_name(collection: str) -> str:
    # md5 because SQL computes the same name (migration 5, rag_keyword_candidates); not a secret.
    return "rag_kw_" + hashlib.md5(collection.encode(), usedforsecurity=False).hexdigest()[:16]


def ensure_pgvector(conn: psycopg.Connection, dsn: str) -> None:
    """Create the `vector` extension if missing and check it is new enough."""
    row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    if row is None:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        except psycopg.errors.InsufficientPrivilege as e:
            raise StoreError(
                f"the pgvector extension is not enabled in {mask_dsn(dsn)} and this role may not "
                "enable it: run `CREATE EXTENSION vector` there as a superuser, then retry"
            ) from e
        except (psycopg.errors.UndefinedFile, psycopg.errors.FeatureNotSupported) as e:
            raise StoreError(
                f"the PostgreSQL server of {mask_dsn(dsn)} has no pgvector: install the pgvector "
                "package (>= 0.8) on the server, or use `rag db start` for a bundled one"
            ) from e
        row = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'").fetchone()
    if parse_version(row[0]) < MIN_PGVECTOR:
        raise StoreError(
            f"pgvector {row[0]} in {mask_dsn(dsn)} is too old (need >= 0.8 for iterative index "
            "scans): install a newer pgvector on the server and run `ALTER EXTENSION vector UPDATE`"
        )


def parse_version(text: str) -> tuple[int, ...]:
    """'0.8.6' -> (0, 8, 6); suffixes like '0.9.0-dev' keep their numeric part."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in text.split("."))


def connect(dsn: str, autocommit: bool = True) -> psycopg.Connection:
    """Open a connection, turning "server does not answer" into a StoreError that says what to do."""
    try:
        return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=10)
    except psycopg.OperationalError as e:
        # libpq's first line says what failed ("Connection refused", "database ... does not exist").
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].removeprefix("connection failed: ")
        raise StoreUnavailable(  # the service answers 503: retry once the server is back
            f"cannot connect to PostgreSQL at {mask_dsn(dsn)} ({mask_dsn(reason)}): start one with "
            "`rag db start`, or check that the server is running and the DSN is right"
        ) from e
    except psycopg.ProgrammingError as e:  # a malformed DSN
        raise StoreError(f"invalid PostgreSQL DSN {mask_dsn(dsn)}: {mask_dsn(str(e).strip())}") from e


@contextlib.contextmanager
def admin_connection(dsn: str, what: str) -> Iterator[psycopg.Connection]:
    """A short-lived autocommit connection whose database errors become StoreErrors naming `what`."""
    conn = connect(dsn, autocommit=True)
    try:
        yield conn
    except psycopg.Error as e:
        raise StoreError(f"{what} in {mask_dsn(dsn)} failed: {e}") from e
    finally:
        conn.close()


_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*(@)")
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)", re.IGNORECASE)


def mask_dsn(dsn: str) -> str:
    """The DSN with any password replaced by ***, for messages and logs."""
    return _KV_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***\2", dsn))


