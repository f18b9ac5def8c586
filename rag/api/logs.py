"""Service logs: the request id of the current request, and one JSON object per line (`rag serve --log-format json`).

Log lines carry what an operator needs to follow a request (method, route template, status,
duration, request id), never the question, the answer, document text or user names.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from typing import Any

# Set by the request-id middleware for the duration of one request; worker threads started with
# asyncio.to_thread see it too (they run in a copy of the request's context).
request_id_var: ContextVar[str | None] = ContextVar("rag_request_id", default=None)

# Attributes every LogRecord has; anything else on a record came in through `extra=`.
_STANDARD = frozenset(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None).__dict__) | {
    "message", "asctime", "request_id", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, then any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None) or request_id_var.get(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class RequestIdFilter(logging.Filter):
    """Puts the current request id on each record (`-` outside a request), for the text format."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get() or "-"
        return True


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def make_handler(log_format: str) -> logging.Handler:
    """A stderr handler in the given format ("json" or "text")."""
    if log_format not in ("json", "text"):
        raise ValueError(f"log format must be 'json' or 'text', got {log_format!r}")
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())  # request_id is null outside a request
    else:
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    return handler


# Libraries that log routine start-up at INFO in a way that reads like failure: Faiss tries each
# CPU build in turn and logs "Could not load library with AVX512 support due to:
# ModuleNotFoundError(...)" over several lines before loading the generic one.
CHATTY_LOGGERS = ("faiss.loader",)


def configure_logging(log_format: str, level: int = logging.INFO) -> dict:
    """Route every logger (uvicorn's too) to one stderr handler in `log_format`.

    Returns:
        the `log_config` to give uvicorn, so that it keeps this set-up instead of installing its own
        (run uvicorn with access_log=False: the service writes its own access lines, by route template).
    """
    logging.basicConfig(level=level, handlers=[make_handler(log_format)], force=True)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    return {"version": 1, "disable_existing_loggers": False,
            "loggers": {name: {"handlers": [], "propagate": True, "level": logging.getLevelName(level)}
                        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}}


def _iso_time(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"
