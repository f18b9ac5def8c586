"""Where users, keys and the audit log live: the data directory (embedded default) or PostgreSQL.

With store = pgvector they live in the store's database, so every `rag serve` replica over it
accepts the same keys, sees a revocation or a change of groups on its next request, and writes
one audit log. Otherwise they stay in the data directory (catalog.sqlite, audit.jsonl).
"""

from __future__ import annotations

from collections.abc import Callable

from permissions.identity import Identity, IdentityStore
from rag.errors import ConfigError
from rag.settings import Settings


def shares_identity(settings: Settings) -> bool:
    """Whether identity and audit live in PostgreSQL (store = pgvector) rather than the data directory."""
    return settings.store == "pgvector"


def store_dsn(settings: Settings) -> str:
    """The PostgreSQL URL of the pgvector store: settings.dsn, else the local server of `rag db start`.

    Raises:
        ConfigError: neither is there.
    """
    if settings.dsn:
        return settings.dsn
    from rag.local_postgres.server import local_dsn

    dsn = local_dsn(settings.home)
    if dsn is None:
        raise ConfigError(
            "store is pgvector but no PostgreSQL server is configured: run `rag db start` "
            "for a local one, or pass --dsn postgresql://USER@HOST:PORT/DB (or set RAG_DSN)")
    return dsn


def open_identity(settings: Settings, dsn: Callable[[], str] | None = None) -> Identity:
    """The identity directory the settings say: PostgreSQL for pgvector (connected on first use), else SQLite."""
    if shares_identity(settings):
        from rag.pg_identity import PgIdentityStore

        return PgIdentityStore(dsn or (lambda: store_dsn(settings)))
    return IdentityStore(settings.catalog_path)


def open_audit_log(settings: Settings, dsn: Callable[[], str] | None = None):
    """The audit log the settings say: the `rag_audit` table for pgvector, else HOME/audit.jsonl."""
    if shares_identity(settings):
        from rag.pg_audit import PgAuditLog

        return PgAuditLog(dsn or (lambda: store_dsn(settings)), settings.audit_questions)
    from rag.audit import AUDIT_FILE, AuditLog

    return AuditLog(settings.home / AUDIT_FILE, settings.audit_questions)
