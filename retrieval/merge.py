"""Joining the Faiss shards of a sharded ingest into the collection of the main data directory.

Each shard holds the documents of one hash partition of the ingested paths, with the chunks and
vectors its job computed. The merge copies them (no re-embedding) so that the collection ends
exactly as one job over the same paths would leave it: shard documents written, main documents
under the ingested paths that no shard has deleted, unchanged ones left alone, ACL-only changes
applied without touching vectors; shards built with another embedder or chunking go into the
collection's next version (`retrieval.rebuild`), as such a job's documents would. The same
copying seeds a new shard from the collection (`sync_documents`), so a shard job re-embeds only
what changed since the last merge.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rag.errors import ConfigError, NotFoundError, StoreError
from rag.settings import check_collection_name
from rag.types import Chunk, Document
from retrieval.catalog import Catalog, DocumentState
from retrieval.rebuild import BuildOutcome, BuildSpec, CollectionBuild, open_for_ingest
from retrieval.shard_dirs import (
    ShardRecord,
    find_shard_dirs,
    read_merged,
    read_record,
    shards_root,
    write_merged,
)

if TYPE_CHECKING:
    from rag.pipeline import Rag
    from retrieval.base import CollectionStore

# Progress callback: (stage, done, total), as ingest's. Stages: "merge" (into the collection),
# "copy" (seeding a shard from it).
ProgressFn = Callable[[str, int, int], None]


@dataclass
class SyncCounts:
    """What bringing one store in line with another did."""

    added: int = 0
    updated: int = 0
    acl_updated: int = 0
    unchanged: int = 0
    deleted: int = 0
    chunks_written: int = 0

    @property
    def changes(self) -> int:
        return self.added + self.updated + self.acl_updated + self.deleted


@dataclass
class MergeReport:
    """What a merge did; `already_merged` when there was nothing new to merge."""

    collection: str
    num_shards: int = 0
    counts: SyncCounts = field(default_factory=SyncCounts)
    already_merged: bool = False
    shards_removed: bool = False
    shards_root: str = ""
    build: BuildOutcome | None = None  # set when the shards were built into a new version of the collection
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"collection": self.collection, "num_shards": self.num_shards, **asdict(self.counts),
                "already_merged": self.already_merged, "shards_removed": self.shards_removed,
                "shards_root": self.shards_root, "build": self.build.as_dict() if self.build else None,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}


@dataclass(frozen=True)
class _Step:
    action: str  # "write" (document, chunks and vectors from `source`), "acl" or "delete"
    key: str
    acl: frozenset[str] = frozenset()
    source: Catalog | None = None


def merge_shards(rag: Rag, collection: str | None = None, keep_shards: bool = False,
                 num_shards: int | None = None, progress: ProgressFn | None = None) -> MergeReport:
    """Join the complete set of Faiss shards of a collection into the main data directory's collection.

    Args:
        rag: the main data directory (its settings name the store and the home).
        num_shards: which run size to merge when shards of several are present.
        keep_shards: leave the shard directories in place (they are removed after a merge otherwise).

    Returns:
        What changed; merging the same shards again changes nothing.

    Shards built with another embedder or chunking than the collection are merged into its next
    version, which replaces it once it holds every document (as one such job would do).

    Raises:
        ConfigError: the store is pgvector, shards of several run sizes and no `num_shards`, or
            the shards were ingested from different paths.
        NotFoundError: no shards, or some of the N are missing or did not finish.
        StoreError: the shards were built with different embedders or chunking settings.
    """
    settings = rag.settings
    if settings.store == "pgvector":
        raise ConfigError("nothing to merge with --store pgvector: shard jobs write straight into the shared "
                          "collection; merge only joins the Faiss shards of the embedded store")
    name = check_collection_name(collection or settings.collection)
    root = shards_root(settings.home, name)
    report = MergeReport(name, shards_root=str(root))
    started = time.perf_counter()
    found = find_shard_dirs(settings.home, name)
    merged = read_merged(settings.home, name)
    if not found:
        if merged is None:
            raise NotFoundError(f"no shards of collection {name!r} under {root}: run `rag ingest PATH... "
                                f"--collection {name} --shard I --num-shards N` for each I first")
        report.num_shards, report.already_merged = merged["num_shards"], True
        return report
    n = _pick_num_shards(name, root, found, num_shards)
    dirs = found[n]
    records = {i: read_record(d) for i, d in dirs.items()}
    report.num_shards = n
    if _is_merged_leftover(merged, n, records):
        # A merge that was stopped while removing shard directories: finish the cleanup.
        report.already_merged = True
        report.shards_removed = not keep_shards and _remove(dirs.values())
        return report
    complete = _check_complete(name, n, dirs, records)
    first = complete[0]
    _check_same_build(name, complete)

    # Where one job with the shards' settings would write: the collection (created if new), or,
    # when it was built with another embedder or chunking, its next version, which replaces it
    # only once complete.
    created = rag.catalog.find_collection(name) is None
    spec = BuildSpec(first.embedder, first.fingerprint, first.dim, first.chunking)
    target = open_for_ingest(rag.catalog, name, spec, settings.index_dir, settings.store, lambda: rag.index(name))
    roots = [Path(p) for p in first.paths]
    catalogs = [Catalog(dirs[i] / "catalog.sqlite") for i in range(n)]
    try:
        t = time.perf_counter()
        wanted: dict[str, tuple[DocumentState, Catalog]] = {}
        for catalog in catalogs:
            if catalog.find_collection(name) is None:
                continue  # a shard whose partition had no documents
            for key, state in catalog.document_states(name).items():
                if is_under(key, roots):  # a shard only speaks for the paths it walked
                    wanted[key] = (state, catalog)
        have = {k: s for k, s in target.document_states().items() if is_under(k, roots)}
        steps = _plan(wanted, have, report.counts)
        report.seconds["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        _apply(steps, name, have, target, report.counts, progress, "merge")
        report.seconds["merge"] = time.perf_counter() - t
    finally:
        for catalog in catalogs:
            catalog.close()
    t = time.perf_counter()
    if isinstance(target, CollectionBuild):
        target.save()
        report.build = target.finish()
    elif steps or created:  # a merge that changed nothing leaves the index file alone too
        target.save()
    write_merged(settings.home, name, dict(enumerate(complete)))
    report.seconds["save"] = time.perf_counter() - t
    report.shards_removed = not keep_shards and _remove(dirs.values())
    report.seconds["total"] = time.perf_counter() - started
    return report


def sync_documents(source: Catalog, collection: str, target: CollectionStore,
                   in_scope: Callable[[str], bool], progress: ProgressFn | None = None) -> SyncCounts:
    """Make the target's documents in scope exactly the source's, copying stored chunks and vectors.

    Documents with the same content hash and chunk count are not rewritten; an ACL difference
    alone is applied with set_acl. Used to seed a shard store from the main collection.
    """
    counts = SyncCounts()
    wanted = {k: (s, source) for k, s in source.document_states(collection).items() if in_scope(k)}
    have = {k: s for k, s in target.document_states().items() if in_scope(k)}
    _apply(_plan(wanted, have, counts), collection, have, target, counts, progress, "copy")
    return counts


def read_document(catalog: Catalog, collection: str, key: str
                  ) -> tuple[Document, frozenset[str], list[Chunk], np.ndarray] | None:
    """A stored document with its ACL, chunks and vectors (n, dim) float32, as replace_document takes them."""
    conn = catalog.conn
    row = conn.execute(
        "SELECT d.id, d.source, d.title, d.content_hash, d.acl, d.metadata, c.dim FROM documents d"
        " JOIN collections c ON c.name = d.collection WHERE d.collection = ? AND d.key = ?",
        (collection, key),
    ).fetchone()
    if row is None:
        return None
    doc_id, source, title, content_hash, acl, metadata, dim = row
    # The catalog keeps no document text (only chunks), and writing a document does not need it.
    doc = Document(key=key, source=source, text="", content_hash=content_hash,
                   acl=frozenset(json.loads(acl)), title=title, metadata=json.loads(metadata))
    chunks, vectors = [], []
    for idx, text, heading, num_tokens, chunk_meta, vector in conn.execute(
        "SELECT idx, text, heading, num_tokens, metadata, vector FROM chunks WHERE document_id = ?"
        " ORDER BY idx", (doc_id,),
    ):
        chunks.append(Chunk(key, idx, text, num_tokens, heading, json.loads(chunk_meta)))
        vectors.append(np.frombuffer(vector, dtype=np.float32))
    matrix = np.stack(vectors) if vectors else np.empty((0, dim), dtype=np.float32)
    return doc, frozenset(json.loads(acl)), chunks, matrix


def is_under(key: str, roots: Sequence[Path]) -> bool:
    """Whether a document key (a path, or PATH#RECORD) lies under one of the ingested roots."""
    path = key.split("#", 1)[0]
    for root in roots:
        r = str(root)
        if path == r or path.startswith(r.rstrip(os.sep) + os.sep):
            return True
    return False


# -- internals -----------------------------------------------------------------------------


def _plan(wanted: dict[str, tuple[DocumentState, Catalog]], have: dict[str, DocumentState],
          counts: SyncCounts) -> list[_Step]:
    steps = []
    for key in sorted(wanted):
        state, source = wanted[key]
        old = have.get(key)
        if old is None or old.content_hash != state.content_hash or old.num_chunks != state.num_chunks:
            steps.append(_Step("write", key, source=source))
        elif old.acl != state.acl:
            steps.append(_Step("acl", key, acl=state.acl))
        else:
            counts.unchanged += 1
    steps.extend(_Step("delete", key) for key in sorted(have.keys() - wanted.keys()))
    return steps


def _apply(steps: list[_Step], collection: str, have: dict[str, DocumentState], target: CollectionStore,
           counts: SyncCounts, progress: ProgressFn | None, stage: str) -> None:
    for done, step in enumerate(steps, 1):
        if step.action == "write":
            assert step.source is not None
            stored = read_document(step.source, collection, step.key)
            if stored is None:
                raise StoreError(f"document {step.key!r} vanished from a shard during the merge: "
                                 "is a shard job still writing? wait for it, then merge again")
            doc, acl, chunks, vectors = stored
            target.replace_document(doc, acl, chunks, vectors)
            counts.chunks_written += len(chunks)
            if step.key in have:
                counts.updated += 1
            else:
                counts.added += 1
        elif step.action == "acl":
            target.set_acl(step.key, step.acl)
            counts.acl_updated += 1
        else:
            target.delete_document(step.key)
            counts.deleted += 1
        if progress:
            progress(stage, done, len(steps))


def _pick_num_shards(name: str, root: Path, found: dict[int, dict[int, Path]], num_shards: int | None) -> int:
    if num_shards is not None:
        if num_shards not in found:
            sizes = ", ".join(str(n) for n in sorted(found))
            raise NotFoundError(f"no shards of a {num_shards}-shard run of collection {name!r} under {root} "
                                f"(found runs of {sizes} shards): pass one of those to --num-shards")
        return num_shards
    if len(found) > 1:
        sizes = ", ".join(str(n) for n in sorted(found))
        raise ConfigError(f"collection {name!r} has shards of runs with {sizes} shards under {root}: pass "
                          "--num-shards N to merge one of them, and delete the other shard directories")
    return next(iter(found))


def _is_merged_leftover(merged: dict | None, n: int, records: dict[int, ShardRecord | None]) -> bool:
    if merged is None or merged.get("num_shards") != n or len(records) >= n:
        return False
    run_ids = merged.get("run_ids", {})
    return all(r is not None and run_ids.get(str(i)) == r.run_id for i, r in records.items())


def _check_complete(name: str, n: int, dirs: dict[int, Path], records: dict[int, ShardRecord | None]
                    ) -> list[ShardRecord]:
    missing = [i for i in range(n) if i not in dirs]
    unfinished = [i for i, r in sorted(records.items())
                  if r is None or not r.is_complete or (r.collection, r.shard, r.num_shards) != (name, i, n)]
    if missing or unfinished:
        problems = []
        if missing:
            problems.append(f"{_shards(missing)} missing")
        if unfinished:
            problems.append(f"{_shards(unfinished)} did not finish (still running, or killed)")
        raise NotFoundError(
            f"cannot merge collection {name!r} from {n} shards: {' and '.join(problems)}; run `rag ingest PATH... "
            f"--collection {name} --shard I --num-shards {n}` for those, then merge again")
    return [r for _, r in sorted(records.items()) if r is not None]


def _check_same_build(name: str, records: list[ShardRecord]) -> None:
    first = records[0]
    for r in records[1:]:
        if r.paths != first.paths:
            raise ConfigError(
                f"the shards of collection {name!r} were ingested from different paths (shard 0: "
                f"{', '.join(first.paths)}; shard {r.shard}: {', '.join(r.paths)}): re-run every shard over the "
                "same paths, then merge again")
        if not r.builds_like(first):
            raise StoreError(
                f"the shards of collection {name!r} were built differently (shard 0: {first.embedder}, chunking "
                f"{first.chunking}; shard {r.shard}: {r.embedder}, chunking {r.chunking}): re-run every shard "
                "with the same embedder and chunking settings, then merge again")


def _shards(indices: list[int]) -> str:
    return ("shard " if len(indices) == 1 else "shards ") + ", ".join(str(i) for i in indices)


def _remove(dirs: Iterable[Path]) -> bool:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return True
