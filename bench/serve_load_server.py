"""The query service as bench/serve_load.py runs it: `rag.api.app.create_app` under uvicorn.

    PYTHONPATH=. python bench/serve_load_server.py --home DIR --port 8311

Settings come from DIR/rag.toml and RAG_* variables (load_settings, as `rag serve` reads them).
Two differences from `rag serve`, both outside the request path: the generator is loaded before
the first request and nothing else (no reranker: the GPU machine has none of the packaged models;
keyword retrieval embeds nothing), and GET /bench/metrics returns the engine's counters and the
admission queue without a key, for the load generator's sampler.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from rag.settings import Settings, load_settings


def build_app(settings: Settings) -> FastAPI:
    """create_app(settings), with the generator loaded at start-up and /bench/metrics added."""
    from rag.api.app import create_app

    app = create_app(settings, preload=False)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with inner(a):
            rag = a.state.rag
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
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    settings = load_settings(home=args.home)
    from bench.stack_sampler import start_from_env

    start_from_env()  # RAG_BENCH_STACKS=FILE: where the server's threads spend their time
    uvicorn.run(build_app(settings), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
