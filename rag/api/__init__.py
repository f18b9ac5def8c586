"""The HTTP API: an app factory whose lifespan owns the pipeline and its models."""

from rag.api.app import create_app

__all__ = ["create_app"]
