"""App factory: `create_app(settings)` builds the FastAPI app; its lifespan owns the Rag and its generator."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from generation.engine.startup_heap import freeze_startup_heap
from rag.api import openapi_docs
from rag.api.error_docs import without_unanswered_422
from rag.api.errors import install_error_handlers
from rag.api.observability import install_observability
from rag.api.routes import chat, documents, health, page, query
from rag.settings import Settings


def create_app(settings: Settings, preload: bool = True, freeze_heap: bool = False) -> FastAPI:
    """Build the API app for one data directory.

    Args:
        settings: where the data lives, which models and generator to use, admission limits.
        preload: load the models queries use at start-up rather than on the first query: the
            embedder, the reranker, and the generator unless answers are extracted
            (`answer_mode`), which never loads it.
        freeze_heap: once preloaded, keep start-up objects out of later full garbage collections
            (`freeze_startup_heap`; process-wide, so for a server process of its own: `rag serve`).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from rag.pipeline import Rag

        rag = Rag(settings)

        def load() -> None:
            if settings.mode != "keyword":  # keyword-only retrieval never embeds a query
                rag.embedder  # noqa: B018 - load models before taking traffic
            extract = rag.answer_mode == "extract"  # decided from settings and weight headers, nothing loaded
            if settings.rerank or extract:  # extraction scores sentences with the cross-encoder
                rag.reranker  # noqa: B018
            if not extract:
                # Extracted answers never generate (no request chooses the mode): loading the
                # generator would only hold its weights and, on a GPU, its KV cache.
                rag.generator  # noqa: B018

        if preload:
            await asyncio.to_thread(load)
        if preload and freeze_heap:
            # Start-up is over: its objects (models, tokenizers, modules) stay out of full GCs,
            # whose pauses otherwise land inside requests (generation/engine/startup_heap.py).
            freeze_startup_heap()
        app.state.rag = rag
        try:
            yield
        finally:
            await rag.aclose_generator()
            await asyncio.to_thread(rag.close)

    # FastAPI's /docs and /redoc load their scripts from a CDN: /docs is served locally instead
    # (rag/api/openapi_docs.py), and there is no /redoc.
    app = FastAPI(title="lab RAG", version="0.2.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_observability(app, settings)  # request ids, access log, GET /metrics
    app.include_router(health.router)
    app.include_router(query.router)
    app.include_router(chat.router)
    app.include_router(documents.router)
    app.include_router(page.router)
    app.include_router(openapi_docs.router)
    _document_errors_only_as_answered(app)
    return app


def _document_errors_only_as_answered(app: FastAPI) -> None:
    """/openapi.json without FastAPI's 422 entries: invalid input is answered 400 (rag/api/errors.py)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = without_unanswered_422(build())
        return app.openapi_schema

    app.openapi = openapi  # FastAPI's documented way to post-process its schema
