"""The query service as bench/serve_load.py runs it: `rag.api.app.create_app` under uvicorn.

    PYTHONPATH=. python bench/serve_load_server.py --home DIR --port 8311

Settings come from DIR/rag.toml and RAG_* variables (load_settings, as `rag serve` reads them).
Two differences from `rag serve`, both outside the request path: the generator is loaded before
the first request (create_app's own preload would also load the embedder, which keyword retrieval
never uses and which the GPU machine does not have), and GET /bench/metrics returns the engine's
counters and the admission queue without a key, for the load generator's sampler.

`--sqlite-per-thread` is a workaround, not the service as shipped: the catalog and the identity
store each share one sqlite3 connection between all of the API's worker threads, and under
concurrent requests (seen on the GPU machine: Python 3.12, 16 cores) calls on it fail or return
garbage (sqlite3.InterfaceError "bad parameter or other API misuse" in Catalog.keyword_search,
None rows, valid keys refused with 401). With the flag, each thread opens its own connection to
the same file (SQLite's WAL mode serves concurrent readers), so the load can be measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from rag.settings import Settings, load_settings


class PerThreadConnection:
    """Stands in for a shared sqlite3.Connection: each thread gets its own connection to the same file."""

    def __init__(self, open_connection) -> None:
        self._open = open_connection
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[sqlite3.Connection] = []

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._open()
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def __getattr__(self, name: str):
        return getattr(self._conn(), name)

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


def per_thread_sqlite(rag) -> None:
    """Give rag.catalog and rag.identity one SQLite connection per thread (the workaround above)."""
    from retrieval.catalog import connect

    path = rag.settings.catalog_path

    def identity_connection() -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    for owner, opener in ((rag.catalog, lambda: connect(path)), (rag.identity, identity_connection)):
        shared = owner.conn
        owner.conn = PerThreadConnection(opener)
        shared.close()


def build_app(settings: Settings, sqlite_per_thread: bool = False) -> FastAPI:
    """create_app(settings), with the generator loaded at start-up and /bench/metrics added."""
    from rag.api.app import create_app

    app = create_app(settings, preload=False)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with inner(a):
            rag = a.state.rag
            if sqlite_per_thread:
                per_thread_sqlite(rag)
            await asyncio.to_thread(lambda: rag.generator)
            yield

    app.router.lifespan_context = lifespan

    @app.get("/bench/metrics")
    async def bench_metrics() -> dict:
        rag = app.state.rag
        generator = rag.__dict__.get("generator")
        out: dict = {"admission": dataclasses.asdict(rag.admission.snapshot())}
        if generator is not None:
            out["engine"] = dataclasses.asdict(generator.metrics())
            engine = generator.engine.engine  # AsyncLLMEngine -> LLMEngine
            cfg = engine.config
            out["engine_config"] = {
                "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "num_kv_blocks": engine.model_runner.num_kv_blocks, "block_size": cfg.block_size,
                "num_scheduler_steps": engine.model_runner.num_scheduler_steps,
                "max_model_len": engine.max_model_len, "device": str(engine.model_runner.device)}
        return out

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--sqlite-per-thread", action="store_true",
                    help="the workaround above (not the service as shipped)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = load_settings(home=args.home)
    uvicorn.run(build_app(settings, args.sqlite_per_thread), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
