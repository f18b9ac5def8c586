"""Joining the Faiss shards of a sharded ingest into the collection of the main data directory.

Each shard holds the documents of one hash partition of the ingested paths, with the chunks and
vectors its job computed. The merge copies them (no re-embedding) so that the collection ends
exactly as one job over the same paths would leave it: shard documents written, main documents
under the ingested paths that no shard has deleted, unchanged ones left alone, ACL-only changes
applied without touching vectors; shards built with another embedder or chunking go into the
collection's next version (`retrieval.rebuild`), as such a job's documents would. The same
copying (`retrieval.sync`) seeds a new shard from the collection, so a shard job re-embeds only
what changed since the last merge.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ingest.sources import is_under_any
from rag.errors import ConfigError, NotFoundError, StoreError
from rag.settings import check_collection_name
from rag.shards.layout import (
    ShardRecord,
    find_shard_dirs,
    read_merged,
    read_record,
    shards_root,
    write_merged,
)
from retrieval.records import BuildOutcome, BuildSpec, DocumentCounts, DocumentState
from retrieval.stores.embedded.catalog import Catalog
from retrieval.sync import ProgressFn, apply, plan

if TYPE_CHECKING:
    from rag.pipeline import Rag

# Progress stages (retrieval.sync.ProgressFn): "merge" (into the collection), "copy" (seeding a
# shard from it).


@dataclass
class MergeReport:
    """What a merge did; `already_merged` when there was nothing new to merge."""

    collection: str
    num_shards: int = 0
    counts: DocumentCounts = field(default_factory=DocumentCounts)
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
    target = rag.stores.for_ingest(name, spec)
    roots = [Path(p) for p in first.paths]
    catalogs = [Catalog(dirs[i] / "catalog.sqlite") for i in range(n)]
    try:
        t = time.perf_counter()
        wanted: dict[str, tuple[DocumentState, Catalog]] = {}
        for catalog in catalogs:
            if catalog.find_collection(name) is None:
                continue  # a shard whose partition had no documents
            for key, state in catalog.document_states(name).items():
                if is_under_any(key, roots):  # a shard only speaks for the paths it walked
                    wanted[key] = (state, catalog)
        have = {k: s for k, s in target.document_states().items() if is_under_any(k, roots)}
        steps = plan(wanted, have, report.counts)
        report.seconds["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        apply(steps, name, have, target, report.counts, progress, "merge")
        report.seconds["merge"] = time.perf_counter() - t
    finally:
        for catalog in catalogs:
            catalog.close()
    t = time.perf_counter()
    building = target.notice is not None  # the collection's next version: finish() renames its saved file
    if steps or created or building:  # a merge that changed nothing leaves the index file alone too
        target.save()
    report.build = target.finish()
    write_merged(settings.home, name, dict(enumerate(complete)))
    report.seconds["save"] = time.perf_counter() - t
    report.shards_removed = not keep_shards and _remove(dirs.values())
    report.seconds["total"] = time.perf_counter() - started
    return report


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
