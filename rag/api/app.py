"""App factory: `create_app(settings)` builds the FastAPI app; its lifespan owns the Rag."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from rag.api.errors import install_error_handlers
from rag.api.routes import health, query
from rag.settings import Settings


def create_app(settings: Settings, preload: bool = True) -> FastAPI:
    """Build the API app for one data directory.

    Args:
        settings: where the data lives and which models to use.
        preload: load the embedder and reranker at start-up rather than on the first query.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from rag.pipeline import Rag

        rag = Rag(settings)
        if preload:
            rag.embedder  # noqa: B018 - load models before taking traffic
            if settings.rerank:
                rag.reranker  # noqa: B018
        app.state.rag = rag
        try:
            yield
        finally:
            rag.close()

    app = FastAPI(title="lab RAG", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(query.router)
    return app
