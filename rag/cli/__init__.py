"""The `rag` command line: `main` (the app and its top-level verbs), one module per sub-app
(`db`, `engine`, `index`, `audit`), `choices` (enum options), `progress` (ingest's bar).

`rag.cli:main` is the console script's entry point.
"""

from rag.cli.main import app, main

__all__ = ["app", "main"]
