"""What a citation calls a source: its path under the ingest root, or a configured URL.

A document's key is its absolute resolved path (what incremental ingest matches on); the name
shown to users must not be, since a server path says who owns what where (`/home/alice/grant/`).
A file is shown as `ROOT/relative/path` (ROOT: the name of the directory that was ingested), or,
when the source tree is published somewhere, as that tree's URL plus the relative path
(`source_urls = {"/data/lab-docs" = "https://wiki.example.org/docs"}` in rag.toml).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from urllib.parse import quote


class SourceNamer:
    """Display names of sources; `urls` maps a source tree (a directory) to its public URL."""

    def __init__(self, urls: Mapping[str, str] | None = None) -> None:
        # Longest tree first, so a nested tree's URL wins over its parent's.
        trees = [(Path(os.path.abspath(os.path.expanduser(d))), u.rstrip("/")) for d, u in (urls or {}).items()]
        self._trees = sorted(trees, key=lambda t: len(t[0].parts), reverse=True)

    def name(self, path: Path, root: Path) -> str:
        """The display name of `path`, a file found under the ingest root `root` (a directory)."""
        path = Path(os.path.abspath(path))
        for tree, url in self._trees:
            if path.is_relative_to(tree):
                return f"{url}/{quote(PurePosixPath(path.relative_to(tree)).as_posix())}"
        root = Path(os.path.abspath(root))
        if path.is_relative_to(root):
            return PurePosixPath(root.name or "/", path.relative_to(root)).as_posix()
        return path.name  # outside its root (cannot happen on a walk): never the full path
