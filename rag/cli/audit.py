"""`rag audit`: the operator's view of the audit log (HOME/audit.jsonl, or PostgreSQL's `rag_audit` with
store = pgvector); no API route reads it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer

from rag.errors import ConfigError

audit_app = typer.Typer(help="The audit log: who asked what (a hash of it), which documents were cited.")


@audit_app.callback(invoke_without_command=True)
def audit(
    ctx: typer.Context,
    user: Annotated[str | None, typer.Option("--user", help="only this user's entries")] = None,
    since: Annotated[str | None, typer.Option(
        "--since", help="only entries at or after this ISO 8601 time (UTC unless it names a zone)")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="only the last N matching entries")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
) -> None:
    """List audit entries of /v1/query and /v1/chat/completions, oldest first (of every replica with
    store = pgvector: they share one log in PostgreSQL).

    Each line: time, status, user, key id (and "via proxy"), collection, latency, cited documents
    and the question's SHA-256 (its text too when audit_questions = true).
    """
    from rag.audit import one_line_json
    from rag.identity_backend import open_audit_log
    from rag.settings import load_settings

    settings = load_settings(home=ctx.find_root().params.get("home"))
    log = open_audit_log(settings)  # the data directory's file, or with store = pgvector the shared table
    try:
        entries = log.read(user=user, since=_parse_time(since), limit=limit)
    finally:
        log.close()
    for e in entries:
        if as_json:
            typer.echo(one_line_json(e, separators=(", ", ": ")))
            continue
        via = " via proxy" if e.get("via_proxy") else ""
        cited = ",".join(e.get("cited") or []) or "-"
        question = f"  {e['question']!r}" if "question" in e else ""
        typer.echo(f"{e['time']}  {e['status']}  {e.get('user') or '-'}  key={e.get('key_id') or '-'}{via}  "
                   f"{e.get('collection') or '-'}  {e.get('latency_ms')} ms  cited={cited}  "
                   f"sha256={(e.get('question_sha256') or '-')[:16]}{question}")


def _parse_time(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(f"--since {value!r} is not an ISO 8601 time, e.g. 2026-12-01 or 2026-12-01T10:30") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)
