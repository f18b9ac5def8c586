"""An app served over real HTTP by uvicorn on a free loopback port, in a thread of the test process.

For tests that must reach into the running app (break its engine, read its state); tests that
need nothing of the kind start `rag serve` as a subprocess (tests/rag/serve_fixture.py).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app: FastAPI, start_timeout: float = 300.0) -> Iterator[str]:
    """Yields the server's base URL once it has started (its lifespan has run); stops it after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
