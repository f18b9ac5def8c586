"""The error tree: every error the project raises on purpose is a RagError.

This module imports nothing from the project, so every package (ingest, retrieval,
generation, permissions) may raise these. Messages say what was wrong and what to do.
Only `rag.api` maps them to HTTP status codes.
"""

from __future__ import annotations


class RagError(Exception):
    """Base of every error raised on purpose by this project."""


class ConfigError(RagError):
    """Bad settings or arguments: a missing path, an unknown choice, an empty question."""


class NotFoundError(RagError):
    """A named thing does not exist: a collection, a user, a model folder."""


class PermissionDenied(RagError):
    """A principal may not do this (never says what it would have seen)."""


class AuthenticationError(RagError):
    """A request carried no API key or one that is unknown."""


class IngestError(RagError):
    """One source could not be ingested; the run goes on and reports it."""


class ParseError(IngestError):
    """A file could not be parsed (corrupt, binary, empty, bad encoding)."""


class StoreError(RagError):
    """The index or catalog is unusable: dimension mismatch, corrupt file, wrong model."""


class StoreUnavailable(StoreError):
    """The database server does not answer or dropped the connection (the service answers 503).

    Nothing is half-written when this is raised mid-write: the transaction rolled back (or
    committed whole). Start the server again and retry; an ingest resumes where it stopped.
    """


class ModelError(RagError):
    """A model could not be found, converted or loaded."""


class GenerationError(RagError):
    """The generator failed or was given an impossible request."""


class GeneratorUnavailable(GenerationError):
    """The generator is down or failed mid-request (the service answers 503, not a hang)."""


class OverloadedError(RagError):
    """Too many requests in flight and in the queue: retry after `retry_after` seconds (HTTP 429)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DeadlineExceeded(RagError):
    """A request ran past its deadline and was stopped (HTTP 504)."""
