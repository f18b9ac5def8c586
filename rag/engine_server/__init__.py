"""An OpenAI-compatible HTTP server over our generation engine alone (`rag engine serve`)."""

from rag.engine_server.app import create_engine_app

__all__ = ["create_engine_app"]
