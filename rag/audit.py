"""The audit log: one JSON line per answered or refused question, appended to HOME/audit.jsonl.

Each entry: `time` (ISO 8601, UTC), `route`, `user` (null when the key was refused before a
user was known), `key_id`, `via_proxy`, `collection`, `question_sha256`, `question` (only with
`audit_questions = true`), `cited` (document keys, never text), `status` (HTTP), `latency_ms`
and `stream`. The file is opened O_APPEND with mode 0600 and each entry is one write(), so
concurrent writers never interleave and nothing rewrites what is there. With store = pgvector the
same lines go to the append-only `rag_audit` table instead (rag/pg_audit.py), one log for every
replica. No API route reads either: `rag audit` (rag/cli/audit.py) is the operator's tool.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rag.private_files import private_mkdir

AUDIT_FILE = "audit.jsonl"
_LINE_BREAKS_ESCAPED = {c: f"\\u{c:04x}" for c in (0x85, 0x2028, 0x2029)}
_MAX_BODY_BYTES = 1 << 20  # a larger body is not parsed for the audit (its question is not hashed)


class AuditLog:
    """Appends entries to one file and reads them back (filters for `rag audit`)."""

    def __init__(self, path: Path, keep_questions: bool = False) -> None:
        self.path = path
        self.keep_questions = keep_questions
        self._lock = threading.Lock()
        self._fd: int | None = None

    def write(self, entry: dict[str, Any]) -> None:
        # Refused requests are logged too, and their text may not be valid Unicode (a lone
        # surrogate escape): keep such characters escaped rather than fail the write.
        line = (one_line_json(entry) + "\n").encode("utf-8", "backslashreplace")
        with self._lock:
            if self._fd is None:
                private_mkdir(self.path.parent)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                os.fchmod(self._fd, 0o600)  # a file made earlier with a looser mode
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def read(self, user: str | None = None, since: datetime | None = None,
             limit: int | None = None) -> list[dict[str, Any]]:
        """Entries in the order written, filtered; with `limit`, the last `limit` that match."""
        if not self.path.exists():
            return []
        since_utc = since.astimezone(UTC) if since is not None else None
        out = []
        for entry in _entries(self.path):
            if user is not None and entry.get("user") != user:
                continue
            if since_utc is not None and datetime.fromisoformat(entry["time"]) < since_utc:
                continue
            out.append(entry)
        return out[-limit:] if limit else out


def one_line_json(entry: dict[str, Any], separators: tuple[str, str] = (",", ":")) -> str:
    """`entry` as JSON that every line reader sees as one line (the log file, `rag audit --json`).

    JSON leaves U+0085, U+2028 and U+2029 raw, and many line readers (Python's splitlines, log
    viewers) break lines there: a collection name a client made up could split an entry or forge a
    second one. Inside JSON output they occur only in strings, so they are escaped.
    """
    return json.dumps(entry, ensure_ascii=False, separators=separators).translate(_LINE_BREAKS_ESCAPED)


def _entries(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash mid-write


@dataclass
class RequestAudit:
    """What one request has told the audit so far; `request.state.audit` holds it."""

    route: str
    started: float = field(default_factory=time.monotonic)
    user: str | None = None
    key_id: str | None = None
    via_proxy: bool = False
    written: bool = False


def audit_log(app) -> AuditLog:
    """The app's audit log, opened on first use: HOME/audit.jsonl, or PostgreSQL's with store = pgvector."""
    log = getattr(app.state, "audit_log", None)
    if log is None:
        from rag.identity_backend import open_audit_log

        rag = app.state.rag
        log = app.state.audit_log = open_audit_log(rag.settings, lambda: rag.dsn)
    return log


async def audit_event(request, answer=None, status: int = 200, stream: bool = False) -> None:
    """Write the request's entry (once): where a route ends, or where its dependency sees it fail.

    Args:
        request: the Starlette request (`request.state.audit` is set by the route's dependency).
        answer: the Answer whose citations are logged (their document keys), if any.
        status: the HTTP status answered.
        stream: the answer was streamed (the latency is then until the stream ended).
    """
    state: RequestAudit | None = getattr(request.state, "audit", None)
    if state is None or state.written:
        return
    state.written = True
    log = audit_log(request.app)
    body = await _body(request)
    question = _question(body)
    collection = body.get("collection") or body.get("model")
    entry = {
        "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "route": state.route,
        "user": state.user,
        "key_id": state.key_id,
        "via_proxy": state.via_proxy,
        "collection": collection if isinstance(collection, str) else request.app.state.rag.settings.collection,
        "question_sha256": _sha256(question) if question is not None else None,
        "cited": _cited(answer),
        "status": status,
        "latency_ms": round((time.monotonic() - state.started) * 1000, 1),
        "stream": stream,
    }
    if log.keep_questions:
        entry["question"] = question
    if getattr(log, "blocking", False):  # a database round trip: off the event loop
        await asyncio.to_thread(log.write, entry)
    else:
        log.write(entry)


async def audited_stream(request, answer, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass a response stream through and write the entry when it ends (or the client leaves)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await audit_event(request, answer, 200, stream=True)


async def _body(request) -> dict[str, Any]:
    try:
        if int(request.headers.get("content-length") or 0) > _MAX_BODY_BYTES:
            return {}
        body = json.loads(await request.body() or b"{}")
    except Exception:  # noqa: BLE001 - an unreadable body is audited without its question
        return {}
    return body if isinstance(body, dict) else {}


def _question(body: dict[str, Any]) -> str | None:
    """The question: /v1/query's `question`, or the last user message of a chat."""
    if isinstance(body.get("question"), str):
        return body["question"]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content
                                    if isinstance(p, dict) and isinstance(p.get("text"), str))
            return content if isinstance(content, str) else None
    return None


def _cited(answer) -> list[str]:
    if answer is None:
        return []
    return list(dict.fromkeys(c.document_key for c in answer.citations))


def _sha256(text: str) -> str:
    # surrogatepass: a refused question may hold a lone surrogate, which strict UTF-8 cannot encode.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
