"""A permission-aware RAG framework for research-computing groups.

This package imports nothing eagerly: `rag.types` and `rag.errors` are leaf modules
that every other package may import without pulling in the service.
"""

__version__ = "0.1.0"
