"""`rag db ...`: start, stop and inspect the local PostgreSQL + pgvector server; migrate a store's schema."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from rag.errors import ConfigError

if TYPE_CHECKING:
    from rag.local_postgres.server import LocalPostgres
    from rag.settings import Settings

db_app = typer.Typer(
    help="A local PostgreSQL + pgvector server under the data directory (for pgvector stores on one "
    "machine and for trying them out), and schema migrations for any pgvector database.",
    no_args_is_help=True,
)


def _settings(ctx: typer.Context) -> Settings:
    from rag.settings import load_settings

    # `rag --home DIR db ...`: the top-level callback's option lives on the root context.
    home = ctx.find_root().params.get("home")
    return load_settings(home=home)


def _server(ctx: typer.Context) -> LocalPostgres:
    from rag.local_postgres.server import LocalPostgres

    settings = _settings(ctx)
    # home_permissions = "refuse" holds here too: an open home is refused, not tightened.
    return LocalPostgres.for_home(settings.home, fix_home=settings.home_permissions == "fix")


@db_app.command()
def start(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="TCP port on 127.0.0.1 (default: the last one used, else a free one)")] = None,
) -> None:
    """Start the local server (creating it on first use) and print its DSN, password included.

    The cluster lives in <home>/postgres/ and keeps its data between starts; the `vector`
    extension is created in its default database. Starting a running server just prints the
    DSN, so `export RAG_DSN=$(rag db start)` is safe to repeat.

    Every login needs the password, so other users of this machine cannot read your documents
    through the server. The printed DSN contains it (it is also in <home>/postgres/password,
    mode 0600): do not paste it into shared places. A server made by an older rag, which let
    anyone in, gets a password now and is restarted if it was running.
    """
    pg = _server(ctx)
    dsn = pg.start(port=port)
    info = pg.status()
    typer.echo(f"PostgreSQL {info['version']} running on port {info['port']}, data in {info['data_dir']}",
               err=True)
    typer.echo(dsn)


@db_app.command()
def stop(ctx: typer.Context) -> None:
    """Stop the local server (fast shutdown: open sessions are ended, data is kept)."""
    if _server(ctx).stop():
        typer.echo("stopped")
    else:
        typer.echo("not running")


@db_app.command()
def status(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option(
        "--json", help="print one JSON object (for scripts: its dsn includes the password)")] = False,
) -> None:
    """Say whether the local server runs, with its pid, port, DSN (password masked), data directory and version."""
    info = _server(ctx).status()
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    state = f"running (pid {info['pid']}) on port {info['port']}" if info["running"] else "stopped"
    typer.echo(f"PostgreSQL {info['version']}: {state}")
    if info["dsn"]:
        from retrieval.stores.pgvector.schema import mask_dsn

        typer.echo(f"dsn:  {mask_dsn(info['dsn'])}")  # status output gets pasted around; `rag db start` prints it whole
    elif info["running"]:
        typer.echo("dsn:  unknown, no password file: run `rag db start` to give the server a password")
    typer.echo(f"data: {info['data_dir']}")
    typer.echo(f"log:  {info['log']}")


@db_app.command()
def migrate(
    ctx: typer.Context,
    dsn: Annotated[str | None, typer.Option(
        "--dsn", help="database URL (default: the configured dsn, else the running local server)")] = None,
) -> None:
    """Create or upgrade the pgvector store's tables in a database and print the schema version.

    Safe to run again: a database already at the current version is left as it is.
    """
    from rag.pg_identity_schema import migrate_identity
    from retrieval.stores.pgvector.schema import mask_dsn
    from retrieval.stores.pgvector.schema import migrate as migrate_schema

    target = _target_dsn(ctx, dsn, "migrate")
    version = migrate_schema(target)
    identity_version = migrate_identity(target)  # users, keys and the audit log of store = pgvector
    typer.echo(f"schema version {version} at {mask_dsn(target)} (identity tables: version {identity_version})")


@db_app.command()
def purge(
    ctx: typer.Context,
    dsn: Annotated[str | None, typer.Option(
        "--dsn", help="URL of a superuser (default: the configured dsn, else the running local server)")] = None,
) -> None:
    """Make the text of deleted, replaced and re-permissioned documents unreadable in the server's files.

    PostgreSQL keeps old row versions (text included) in its table files and WAL until they are
    rewritten: this runs VACUUM FULL on the store's tables, rewrites the statistics and lets the
    server drop old WAL. It locks the tables while it runs (minutes on a large collection): run it
    in a quiet period, after ingest runs that deleted or re-permissioned documents. Needs a
    superuser (the local server's DSN is one). WAL archives, replicas and backups are the server
    operator's to expire (see README, "Deleted documents").
    """
    from retrieval.stores.pgvector.purge import purge_removed_text
    from retrieval.stores.pgvector.schema import mask_dsn

    target = _target_dsn(ctx, dsn, "purge")
    purge_removed_text(target)
    typer.echo(f"purged removed text at {mask_dsn(target)}")


def _target_dsn(ctx: typer.Context, dsn: str | None, verb: str) -> str:
    """--dsn, else the configured dsn, else the running local server's."""
    from rag.local_postgres.server import local_dsn

    settings = _settings(ctx)
    target = dsn or getattr(settings, "dsn", None) or local_dsn(settings.home)
    if not target:
        raise ConfigError(f"no database to {verb}: run `rag db start` for a local server, or pass --dsn URL")
    return target

