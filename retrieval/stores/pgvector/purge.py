"""Making deleted text unreadable in a PostgreSQL server's files (pgvector store).

A DELETE or UPDATE in PostgreSQL leaves the old row version, text included, in the table's
pages until VACUUM; plain VACUUM only marks that space reusable (the bytes stay until a later
row overwrites them), and GIN/HNSW index entries and `pg_statistic` samples keep copies of
their own. So removed text is purged by rewriting: VACUUM FULL writes each table and all its
indexes into new files and truncates the old ones, ANALYZE replaces the statistics (their old
rows are rewritten away too), and a checkpoint followed by a WAL switch and a second
checkpoint lets the server drop the WAL segments that recorded the text. Those segments are
deleted only with `wal_recycle = off`; otherwise they are renamed for reuse and keep their old
bytes until overwritten. WAL archives, replicas and base backups are outside this function's
reach: see docs/architecture.md, "Deleted text".

VACUUM FULL locks each table against reads and writes while it rewrites it (the HNSW indexes
are rebuilt too): run this in a quiet period, after deleting or re-permissioning documents.
"""

from __future__ import annotations

import logging

import psycopg

from rag.errors import StoreError
from retrieval.stores.pgvector.schema import connect, mask_dsn, migrate

# Tables that hold document text, keys, titles or words (rag_keyword_domains holds ACLs only).
TEXT_TABLES = ("rag_chunks", "rag_documents")

log = logging.getLogger(__name__)


def purge_removed_text(dsn: str) -> None:
    """Rewrite the store's tables and indexes without dead rows, then let the server drop old WAL.

    Args:
        dsn: the migrated database. Rewriting pg_statistic, CHECKPOINT and pg_switch_wal need a
            superuser (or the pg_checkpoint role and a grant on pg_switch_wal).

    Raises:
        StoreError: the server does not answer, or this role may not run a step (the message
            names it and what to grant; the steps before it did run).
    """
    migrate(dsn)
    steps = [(f"VACUUM (FULL, ANALYZE) {table}", f"own the table {table}") for table in TEXT_TABLES]
    steps += [
        # ANALYZE wrote new statistics; the old rows, with sampled text, are dead until rewritten.
        ("VACUUM FULL pg_catalog.pg_statistic", "be a superuser"),
        ("CHECKPOINT", "be a superuser or have the pg_checkpoint role"),
        ("SELECT pg_switch_wal()", "be a superuser or be granted EXECUTE on pg_switch_wal()"),
        ("CHECKPOINT", "be a superuser or have the pg_checkpoint role"),
    ]
    with connect(dsn, autocommit=True) as conn:  # VACUUM cannot run inside a transaction
        _warn_about_retained_wal(conn, dsn)
        # VACUUM skips a table this role may not vacuum with only a WARNING: treat it as refused.
        warnings: list[str] = []
        conn.add_notice_handler(lambda d: warnings.append(d.message_primary or "")
                                if d.severity_nonlocalized == "WARNING" else None)
        for statement, need in steps:
            try:
                conn.execute(statement)
                if warnings:
                    raise psycopg.errors.InsufficientPrivilege(warnings[0])
            except psycopg.errors.InsufficientPrivilege as e:
                raise StoreError(
                    f"purging removed text in {mask_dsn(dsn)}: `{statement}` was refused ({e}); the role "
                    f"must {need}, or ask the server's operator to run it (docs/architecture.md, 'Deleted text')"
                ) from e
            except psycopg.Error as e:
                raise StoreError(f"purging removed text in {mask_dsn(dsn)}: `{statement}` failed: {e}") from e


def _warn_about_retained_wal(conn: psycopg.Connection, dsn: str) -> None:
    """Say where WAL with the removed text outlives this purge (settings only an operator can change)."""
    settings = dict(conn.execute(
        "SELECT name, setting FROM pg_settings WHERE name IN ('wal_recycle', 'archive_mode')").fetchall())
    if settings.get("wal_recycle") == "on":
        log.warning("%s recycles WAL segments (wal_recycle = on): released segments keep their old bytes, "
                    "removed text included, until overwritten; set wal_recycle = off", mask_dsn(dsn))
    if settings.get("archive_mode", "off") != "off":
        log.warning("%s archives WAL (archive_mode = %s): the archive keeps removed text until its "
                    "retention expires", mask_dsn(dsn), settings["archive_mode"])
