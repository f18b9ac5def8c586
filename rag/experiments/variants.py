"""Collections built with other index settings (chunking, embedder, store) for experiments.

A configuration whose index settings are the Rag's own queries the Rag's collection: nothing
is built, nothing re-embedded. Any other is built once per build spec (embedder, chunking,
store) in its own data directory, `HOME/experiments/SPEC-HASH/` (owner-only, like HOME: it
holds the corpus's text), in a collection named `exp-SPEC-HASH` (so a variant on a shared
pgvector server never touches a real collection). The build is cached: the same spec in the
same session returns the same variant, and a later session finds the directory and brings it
up to date incrementally (unchanged documents are skipped).

Embeddings are reused where nothing changed: a variant that differs only in its store is
copied from the Rag's collection, chunks and vectors (`retrieval.sync`), with no embedding.
A new chunking or embedder embeds the corpus again (other chunks, or another model).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from ingest.pipeline import ProgressFn
from rag.errors import ConfigError
from rag.experiments.configs import Config
from rag.pipeline import Rag
from rag.private_files import private_mkdir
from rag.settings import Settings

# Loaded models a variant may share with the Rag it derives from (same setting, same device).
_SHARED_MODELS = {"embedder": "embedder", "reranker": "reranker"}


class IndexVariants:
    """The collections an experiment queries, one per build spec, built on first use."""

    def __init__(self, rag: Rag, corpus: Sequence[str | Path], collection: str | None = None,
                 cache_dir: str | Path | None = None, progress: ProgressFn | bool | None = None) -> None:
        self.rag = rag
        self.corpus = [Path(p) for p in corpus]
        self.collection = collection or rag.settings.collection
        self.cache_dir = Path(cache_dir) if cache_dir is not None else rag.settings.home / "experiments"
        self.progress = progress
        self._built: dict[str, tuple[Rag, str]] = {}
        self.builds: list[dict] = []  # what each build did: spec, how (copied or ingested), counts

    def settings_for(self, config: Config) -> Settings:
        """The Rag's settings with the configuration's index settings applied."""
        return self.rag.settings.model_copy(update=config.index_settings())

    def for_config(self, config: Config) -> tuple[Rag, str]:
        """(the Rag to query, its collection) for a configuration; builds the variant if needed."""
        base = self.rag.settings
        changes = {k: v for k, v in config.index_settings().items() if getattr(base, k) != v}
        if not changes:
            return self.rag, self.collection
        key = spec_key(self.settings_for(config), self.collection)
        if key not in self._built:
            self._built[key] = self._build(key, changes)
        return self._built[key]

    def _build(self, key: str, changes: dict) -> tuple[Rag, str]:
        home = private_mkdir(self.cache_dir / key)
        link = home / "models"  # converted models are shared, not converted again per variant
        if not link.exists() and not link.is_symlink():
            link.symlink_to(private_mkdir(self.rag.settings.model_cache).resolve(), target_is_directory=True)
        update = {**changes, "home": home, "collection": f"exp-{key}"}
        if changes.get("store", self.rag.settings.store) == "pgvector":
            update["dsn"] = self.rag.dsn  # the Rag's server (its local one lives under its own home)
        settings = Settings(**{**self.rag.settings.model_dump(), **update})
        variant = Rag(settings)
        self._share_models(variant)
        name = settings.collection
        source = self.rag.catalog.find_collection(self.collection)
        if set(changes) == {"store"} and source is not None:
            counts = self._copy(variant, name, source.name)
            self.builds.append({"variant": key, "changes": changes, "how": "copied",
                                "documents_written": counts.added + counts.updated, "chunks_embedded": 0})
        else:
            if not self.corpus:
                raise ConfigError(f"configuration {changes} needs its own index, but no corpus was given to "
                                  "build it from: pass corpus=[...] (the paths you ingested)")
            # Sources that fail here failed in the Rag's own ingest too: the variant holds the same set.
            report = variant.ingest(self.corpus, name, progress=self.progress)
            self.builds.append({"variant": key, "changes": changes, "how": "ingested",
                                "documents_written": report.added + report.updated,
                                "chunks_embedded": report.chunks_embedded, "problems": len(report.problems)})
        return variant, name

    def _copy(self, variant: Rag, name: str, source_name: str):
        """The Rag's stored chunks and vectors into another store: no parsing, no embedding."""
        from retrieval.sync import sync_documents

        target = variant.collection(name, create=True)
        counts = sync_documents(self.rag.catalog, source_name, target, lambda _key: True)
        target.save()
        target.finish()
        return counts

    def _share_models(self, variant: Rag) -> None:
        # Rag loads models lazily into cached properties; a variant with the same model setting
        # gets the loaded one (seconds and memory saved per variant). Generators are not shared:
        # each runs on its own Rag's event loop.
        for attribute, setting in _SHARED_MODELS.items():
            same = getattr(variant.settings, setting) == getattr(self.rag.settings, setting)
            if same and variant.settings.device == self.rag.settings.device and attribute in self.rag.__dict__:
                variant.__dict__[attribute] = self.rag.__dict__[attribute]

    def share_loaded_models(self) -> None:
        """Give every variant the models the Rag has loaded since (call before querying them)."""
        for variant, _ in self._built.values():
            self._share_models(variant)

    def close(self) -> None:
        """Close the variants' Rags (models shared with the Rag stay open for it)."""
        for variant, _ in self._built.values():
            for attribute in _SHARED_MODELS:
                if variant.__dict__.get(attribute) is self.rag.__dict__.get(attribute, object()):
                    del variant.__dict__[attribute]
            variant.close()
        self._built.clear()

    def remove(self) -> None:
        """Close and delete every variant's data directory (a pgvector variant's rows stay: `rag db purge`)."""
        self.close()
        if self.cache_dir.is_dir():
            shutil.rmtree(self.cache_dir)


def spec_key(settings: Settings, collection: str) -> str:
    """A short stable name for what an index is built from: embedder, chunking, store, source collection."""
    spec = {"embedder": settings.embedder, "chunk_max_tokens": settings.chunk_max_tokens,
            "chunk_overlap_tokens": settings.chunk_overlap_tokens, "store": settings.store,
            "dsn": settings.dsn if settings.store == "pgvector" else None, "collection": collection}
    if settings.chunk_title_context:  # only when on: variants built before it existed keep their names
        spec["chunk_title_context"] = True
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
