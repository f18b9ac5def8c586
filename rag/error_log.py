"""Logging an unexpected exception of an HTTP server without the text of the request that caused it.

An exception's message often quotes its input (a UnicodeEncodeError holds the string, a SQLite
or tokenizer error the value, a KeyError the key), and a request's input is a question, chat
history or document text the log's readers may not read. So the log gets the exception's type
and where it was raised (every frame, chained causes too), never its message or arguments.
"""

from __future__ import annotations

import logging
import traceback


def log_exception(logger: logging.Logger, what: str, exc: BaseException) -> None:
    """Log `what` at ERROR with the exception's type and stack, without its message."""
    logger.error("%s: %s\n%s", what, type(exc).__name__, redacted_traceback(exc))


def redacted_traceback(exc: BaseException) -> str:
    """The frames of `exc` and its causes (file, line, function, source line), with type names only."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)
        parts.append(f"{type(current).__module__}.{type(current).__qualname__} (message withheld)\n"
                     + "".join(traceback.format_list(frames)))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
        if current is not None:
            parts.append("raised while handling / caused by:\n")
    return "".join(parts).rstrip("\n")
