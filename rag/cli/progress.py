"""The live display of `rag ingest`: the same bars as the Python API's (rag/progress.py)."""

from rag.progress import IngestProgress

__all__ = ["IngestProgress"]
