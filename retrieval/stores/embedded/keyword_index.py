"""The catalog's keyword index, split into one FTS5 table per ACL domain (collection, ACL).

Why split: a single FTS5 table over every chunk reads the whole posting list of a query term,
then drops the rows the caller may not read, so the work of a keyword search (and its time)
grew with the number of *unreadable* chunks containing the term: a caller could tell whether
a guessed identifier occurs in documents they may not open. Here all chunks of one domain share
one ACL, and a search opens only the tables of domains the principal may read, so every term
lookup, posting and row it visits belongs to a readable chunk (the work is counted in
tests/retrieval/test_keyword_work.py). Unreadable text is never searched.

A domain table is an external-content FTS5 table whose content is a view of that domain's
chunks (no second copy of the text; 'rebuild' and 'integrity-check' work per domain). The
catalog keeps domains in step inside its write transactions (`index_chunks`,
`unindex_chunks`, `rename_collection`, `drop_collection_domains`). Removals leave
"delete" entries in FTS5 segments whose older segments still hold the removed words (SQLite
3.40 has no FTS5 secure-delete), so a removal marks its domain and `purge` later rewrites the
index of every marked domain ('optimize') and drops domains left empty.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from retrieval.keyword import bm25_over_readable, fts5_match, query_terms

# Porter + unicode61 as before the split: `E-VCF-017` is "e vcf 017", "nodes" finds "node".
TOKENIZE = "porter unicode61 remove_diacritics 2"
# Stored in the catalog: a change here (another tokenizer) rebuilds every domain on open.
FORMAT = f"domains-1 tokenize={TOKENIZE}"

DOMAIN_SCHEMA = """
CREATE TABLE IF NOT EXISTS keyword_format (format TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS keyword_domains (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    collection TEXT NOT NULL,
    acl TEXT NOT NULL,                          -- documents.acl (sorted JSON) of its chunks
    num_chunks INTEGER NOT NULL DEFAULT 0,      -- BM25 statistics without reading the chunks
    num_tokens INTEGER NOT NULL DEFAULT 0,
    needs_purge INTEGER NOT NULL DEFAULT 0,     -- removed words may remain in its segments
    UNIQUE (collection, acl)
);
CREATE TABLE IF NOT EXISTS keyword_domain_acl (
    principal TEXT NOT NULL,
    domain_id INTEGER NOT NULL REFERENCES keyword_domains(id) ON DELETE CASCADE,
    PRIMARY KEY (principal, domain_id)
);
"""

# Chunk rows as the index needs them: (chunk id, text, heading, num_tokens).
ChunkText = tuple[int, str, str | None, int]


def table_name(domain_id: int) -> str:
    return f"chunks_fts_{int(domain_id)}"


def _view_name(domain_id: int) -> str:
    return f"chunks_fts_{int(domain_id)}_content"


@dataclass(frozen=True)
class ReadableDomains:
    """The domains a principal may read in one collection, with their BM25 statistics."""

    ids: tuple[int, ...]
    acls: frozenset[str]  # their documents.acl strings (a post-check of every match)
    num_chunks: int
    num_tokens: int


def create_tables(conn: sqlite3.Connection) -> None:
    """Create the bookkeeping tables if missing (no write when they exist)."""
    conn.executescript(DOMAIN_SCHEMA)


def needs_rebuild(conn: sqlite3.Connection) -> bool:
    """Whether the index is missing, single-table (older catalogs) or of another format."""
    row = conn.execute("SELECT format FROM keyword_format").fetchone()
    legacy = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'chunks_fts'").fetchone()
    return row is None or row[0] != FORMAT or legacy is not None


def rebuild_all(conn: sqlite3.Connection) -> None:
    """Drop every keyword table (and the single pre-domain one) and index all chunks again.

    Runs inside the caller's write transaction (a catalog made before domains, or with another
    tokenizer): reads every chunk once, domain by domain.
    """
    for trigger in ("chunks_fts_insert", "chunks_fts_delete", "chunks_fts_update"):
        conn.execute(f"DROP TRIGGER IF EXISTS {trigger}")
    conn.execute("DROP TABLE IF EXISTS chunks_fts")
    for (domain_id,) in conn.execute("SELECT id FROM keyword_domains").fetchall():
        _drop(conn, domain_id)
    conn.execute("DELETE FROM keyword_format")
    conn.execute("INSERT INTO keyword_format (format) VALUES (?)", (FORMAT,))
    pairs = conn.execute("SELECT DISTINCT collection, acl FROM documents ORDER BY collection, acl").fetchall()
    for collection, acl in pairs:
        domain_id = _domain(conn, collection, acl)
        table = table_name(domain_id)
        conn.execute(f"INSERT INTO {table} ({table}) VALUES ('rebuild')")
        conn.execute(
            "UPDATE keyword_domains SET (num_chunks, num_tokens) = (SELECT COUNT(*), COALESCE(SUM(num_tokens), 0)"
            f" FROM chunks WHERE id IN (SELECT id FROM {_view_name(domain_id)})) WHERE id = ?", (domain_id,))


def index_chunks(conn: sqlite3.Connection, collection: str, acl: str, rows: Sequence[ChunkText]) -> None:
    """Add chunks of a document with ACL `acl` (documents.acl JSON) to their domain."""
    if not rows:
        return
    domain_id = _domain(conn, collection, acl)
    table = table_name(domain_id)
    conn.executemany(f"INSERT INTO {table} (rowid, text, heading) VALUES (?, ?, ?)",
                     [(cid, text, heading) for cid, text, heading, _ in rows])
    conn.execute("UPDATE keyword_domains SET num_chunks = num_chunks + ?, num_tokens = num_tokens + ? WHERE id = ?",
                 (len(rows), sum(r[3] for r in rows), domain_id))


def unindex_chunks(conn: sqlite3.Connection, collection: str, acl: str, rows: Sequence[ChunkText]) -> None:
    """Remove chunks (with the text they were indexed with) from their domain, and mark it for `purge`."""
    if not rows:
        return
    found = conn.execute("SELECT id FROM keyword_domains WHERE collection = ? AND acl = ?",
                         (collection, acl)).fetchone()
    assert found is not None, f"chunks of {collection!r} with ACL {acl} were never indexed"
    table = table_name(found[0])
    conn.executemany(f"INSERT INTO {table} ({table}, rowid, text, heading) VALUES ('delete', ?, ?, ?)",
                     [(cid, text, heading) for cid, text, heading, _ in rows])
    conn.execute("UPDATE keyword_domains SET num_chunks = num_chunks - ?, num_tokens = num_tokens - ?,"
                 " needs_purge = 1 WHERE id = ?", (len(rows), sum(r[3] for r in rows), found[0]))


def rename_collection(conn: sqlite3.Connection, old: str, new: str) -> None:
    """The domains of collection `old` now belong to `new` (their tables are named by id)."""
    conn.execute("UPDATE keyword_domains SET collection = ? WHERE collection = ?", (new, old))


def drop_collection_domains(conn: sqlite3.Connection, collection: str) -> None:
    """Drop every domain table of a collection whose documents are gone."""
    for (domain_id,) in conn.execute("SELECT id FROM keyword_domains WHERE collection = ?",
                                     (collection,)).fetchall():
        _drop(conn, domain_id)


def readable_domains(conn: sqlite3.Connection, collection: str, tokens: Iterable[str]) -> ReadableDomains:
    """The domains of `collection` whose ACL names one of `tokens` (an index seek per token)."""
    tokens = sorted(set(tokens))
    if not tokens:
        return ReadableDomains((), frozenset(), 0, 0)
    marks = ",".join("?" * len(tokens))
    # CROSS JOIN keeps the principal index as the outer loop: the rows visited are the domains
    # naming one of `tokens`, never a scan of the collection's domains (how many ACLs exist).
    rows = conn.execute(
        "SELECT DISTINCT k.id, k.acl, k.num_chunks, k.num_tokens FROM keyword_domain_acl a"
        f" CROSS JOIN keyword_domains k ON k.id = a.domain_id WHERE a.principal IN ({marks})"
        " AND k.collection = ? ORDER BY k.id",
        (*tokens, collection),
    ).fetchall()
    return ReadableDomains(tuple(r[0] for r in rows), frozenset(r[1] for r in rows),
                           sum(r[2] for r in rows), sum(r[3] for r in rows))


def match(conn: sqlite3.Connection, domains: ReadableDomains, terms: Sequence[str]) -> dict[str, set[int]]:
    """term -> ids of chunks in `domains` that contain it; only those domains' tables are read."""
    matches: dict[str, set[int]] = {term: set() for term in terms}
    for domain_id in domains.ids:
        table = table_name(domain_id)
        # One statement per domain for all terms: per-term sets are needed for BM25's document
        # frequency, and one round of prepare/step per term and domain would dominate.
        statement = " UNION ALL ".join(
            f"SELECT {n}, rowid FROM {table} WHERE {table} MATCH ?" for n in range(len(terms)))
        for n, rowid in conn.execute(statement, [fts5_match([t]) for t in terms]):
            matches[terms[n]].add(int(rowid))
    return matches


def search(conn: sqlite3.Connection, collection: str, text: str, k: int, tokens: Iterable[str]
           ) -> list[tuple[int, float]]:
    """BM25 top-k among the chunks whose document ACL names one of `tokens`.

    Only the keyword tables of the collection's ACL domains that `tokens` may read are
    searched, so a principal who may read few chunks still
    gets up to k of them however many unreadable chunks match better, and the work done
    (pages, postings, rows) depends only on readable chunks. A
    chunk matches when it contains any term of `text` (see `keyword.query_terms`). Scores
    use term statistics of the readable chunks only (`keyword.bm25_over_readable`): FTS5's
    own bm25() counts every chunk, and its scores would hint at unreadable text.

    Returns:
        (chunk id, score) best first (higher is better), ties by id; [] when `tokens` is
        empty or `text` has no usable terms.
    """
    terms = query_terms(text)
    if not terms or k <= 0:
        return []
    # Only the FTS tables of readable domains are opened: every posting the search visits
    # belongs to a chunk the principal may read, so its work says nothing about the rest.
    domains = readable_domains(conn, collection, tokens)
    if not domains.ids:
        return []
    matches = match(conn, domains, terms)
    found = sorted(set().union(*matches.values()))
    chunks: dict[int, tuple[float, str, str | None]] = {}
    for start in range(0, len(found), 500):
        part = found[start : start + 500]
        for cid, num_tokens, chunk_text, heading, doc_collection, acl in conn.execute(
            "SELECT c.id, c.num_tokens, c.text, c.heading, d.collection, d.acl FROM chunks c"
            f" JOIN documents d ON d.id = c.document_id WHERE c.id IN ({','.join('?' * len(part))})",
            part,
        ):
            # A chunk indexed in a domain its document no longer has would be a bug: drop it.
            if doc_collection == collection and acl in domains.acls:
                chunks[int(cid)] = (float(num_tokens), chunk_text, heading)
    if not chunks:
        return []
    matches = {term: ids & chunks.keys() for term, ids in matches.items()}
    return bm25_over_readable(matches, chunks, domains.num_chunks,
                              domains.num_tokens / max(domains.num_chunks, 1), k)


def purge(conn: sqlite3.Connection) -> int:
    """Rewrite the index of every domain with removals, and drop empty domains; returns domains purged.

    'optimize' merges a domain's segments into one, leaving out deleted entries, so the words
    of removed or re-permissioned chunks no longer sit in its pages (with secure_delete on, the
    freed pages are zeroed). It also makes later searches of the domain skip tombstones whose
    number depended on what was removed. Runs in the caller's write transaction.
    """
    rows = conn.execute("SELECT id, num_chunks FROM keyword_domains WHERE needs_purge = 1").fetchall()
    for domain_id, num_chunks in rows:
        if num_chunks <= 0:
            _drop(conn, domain_id)
            continue
        table = table_name(domain_id)
        conn.execute(f"INSERT INTO {table} ({table}) VALUES ('optimize')")
        conn.execute("UPDATE keyword_domains SET needs_purge = 0 WHERE id = ?", (domain_id,))
    return len(rows)


def needs_purge(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM keyword_domains WHERE needs_purge = 1 LIMIT 1").fetchone() is not None


def integrity_check(conn: sqlite3.Connection) -> None:
    """FTS5's own check of every domain against its chunks; raises sqlite3.DatabaseError on a difference."""
    for (domain_id,) in conn.execute("SELECT id FROM keyword_domains").fetchall():
        table = table_name(domain_id)
        conn.execute(f"INSERT INTO {table} ({table}, rank) VALUES ('integrity-check', 1)")


# -- internals -------------------------------------------------------------------------------


def _domain(conn: sqlite3.Connection, collection: str, acl: str) -> int:
    """The id of domain (collection, acl), creating its view, FTS table and principal rows if new."""
    row = conn.execute("SELECT id FROM keyword_domains WHERE collection = ? AND acl = ?",
                       (collection, acl)).fetchone()
    if row is not None:
        return int(row[0])
    domain_id = int(conn.execute("INSERT INTO keyword_domains (collection, acl) VALUES (?, ?)",
                                 (collection, acl)).lastrowid)
    principals = sorted(set(json.loads(acl)))  # an empty ACL gets no rows: no principal reads it
    conn.executemany("INSERT INTO keyword_domain_acl (principal, domain_id) VALUES (?, ?)",
                     [(p, domain_id) for p in principals])
    view = _view_name(domain_id)
    # The view names the domain by id, so renaming its collection (promote) needs no new view.
    conn.execute(
        f"CREATE VIEW {view} AS SELECT c.id AS id, c.text AS text, c.heading AS heading FROM keyword_domains k"
        " JOIN documents d ON d.collection = k.collection AND d.acl = k.acl JOIN chunks c ON c.document_id = d.id"
        f" WHERE k.id = {domain_id}")
    conn.execute(f"CREATE VIRTUAL TABLE {table_name(domain_id)} USING fts5(text, heading, content='{view}',"
                 f" content_rowid='id', tokenize='{TOKENIZE}')")
    return domain_id


def _drop(conn: sqlite3.Connection, domain_id: int) -> None:
    conn.execute(f"DROP TABLE IF EXISTS {table_name(domain_id)}")
    conn.execute(f"DROP VIEW IF EXISTS {_view_name(domain_id)}")
    conn.execute("DELETE FROM keyword_domain_acl WHERE domain_id = ?", (domain_id,))
    conn.execute("DELETE FROM keyword_domains WHERE id = ?", (domain_id,))
