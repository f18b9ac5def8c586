"""PostgreSQL tables of the shared identity (users, groups, API keys) and the shared audit log.

With store = pgvector every replica reads users, keys and the audit log from the store's
database rather than from its own data directory. Versioned like the pgvector schema
(retrieval/stores/pgvector/schema.py), in a track of its own (`rag_identity_schema_version`,
another advisory lock): identity needs no pgvector extension, and either schema can move on
alone. The fast path is one read of the version table; only a database that is behind takes
the lock, so replicas starting at once apply each migration exactly once.

Every change to `rag_users` or `rag_api_keys` (ours, or an operator's hand edit) bumps the one
row of `rag_identity_version` in the same transaction, through a statement trigger: replicas
compare it with the version their cache was filled at (rag/pg_identity.py).
"""

from __future__ import annotations

from retrieval.stores.pgvector.migrations import MigrationSet
from retrieval.stores.pgvector.migrations import migrate as run_migrations
from retrieval.stores.pgvector.schema import connect, mask_dsn

_MIGRATION_LOCK = 0x7261675F696469  # "rag_idi": not the pgvector schema's lock

MIGRATIONS: list[tuple[int, str]] = [
    (1, """
CREATE TABLE rag_users (
    name       text PRIMARY KEY,
    groups     text[] NOT NULL,
    created_at double precision NOT NULL
);
-- Only a SHA-256 of each key (rag_<id>_<secret>): the key itself is shown once and never stored.
CREATE TABLE rag_api_keys (
    key_id     text PRIMARY KEY,
    key_hash   text NOT NULL CHECK (key_hash ~ '^[0-9a-f]{64}$'),
    user_name  text NOT NULL,
    groups     text[] NOT NULL,       -- a record of the key's creation, never a source of access
    label      text,
    created_at double precision NOT NULL,
    revoked    boolean NOT NULL DEFAULT false,
    kind       text NOT NULL DEFAULT 'user' CHECK (kind IN ('user', 'proxy')),
    scope      text[],
    admin      boolean NOT NULL DEFAULT false
);
CREATE TABLE rag_identity_version (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    version  bigint NOT NULL
);
INSERT INTO rag_identity_version (version) VALUES (1);
CREATE FUNCTION rag_identity_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE rag_identity_version SET version = version + 1;
    RETURN NULL;
END $$;
CREATE TRIGGER rag_users_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON rag_users
    FOR EACH STATEMENT EXECUTE FUNCTION rag_identity_changed();
CREATE TRIGGER rag_api_keys_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON rag_api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION rag_identity_changed();
-- The audit log: one row per answered or refused question, from every replica. `entry` is the
-- JSON line the embedded default writes to audit.jsonl, kept as text (key order and all).
CREATE TABLE rag_audit (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL,
    user_name text,
    entry     text NOT NULL
);
CREATE INDEX rag_audit_at ON rag_audit (at);
CREATE INDEX rag_audit_user ON rag_audit (user_name, id);
-- Append-only: nothing rewrites or removes entries through rag. An operator who expires old
-- entries does it deliberately (ALTER TABLE rag_audit DISABLE TRIGGER rag_audit_append_only).
CREATE FUNCTION rag_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rag_audit is append-only';
END $$;
CREATE TRIGGER rag_audit_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON rag_audit
    FOR EACH STATEMENT EXECUTE FUNCTION rag_audit_append_only();
"""),
]

LATEST = MIGRATIONS[-1][0]
IDENTITY_STEPS = MigrationSet(MIGRATIONS, "rag_identity_schema_version", _MIGRATION_LOCK, "the rag identity tables")


def migrate_identity(dsn: str) -> int:
    """Bring the identity tables at `dsn` to the latest version; safe from many processes at once.

    Returns:
        The identity schema version now in the database.

    Raises:
        StoreError: the server does not answer, or a newer version of this project migrated it.
    """
    with connect(dsn, autocommit=True) as conn:
        return run_migrations(conn, IDENTITY_STEPS, mask_dsn(dsn))
