"""Sharded ingest for Slurm job arrays: which shard a job is, and where its documents go.

`rag ingest --shard I --num-shards N` handles the documents whose key hashes to shard I
(`ingest.pipeline.shard_of`). With pgvector every shard writes straight into the shared
collection (the store takes concurrent writers). With the embedded store each shard writes a
data directory of its own (`rag.shards.layout`), seeded from the main collection so that
only changed documents are embedded, and `rag index merge` joins the shards afterwards.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ingest.deletion_guard import DeletionGuard
from ingest.pipeline import IngestReport, ProgressFn, shard_of
from ingest.sources import has_sources, is_under_any, scan_roots
from rag.errors import ConfigError
from rag.ingest_run import run_ingest
from rag.private_files import private_mkdir
from rag.settings import check_collection_name
from rag.shards.layout import COMPLETE, INGESTING, ShardRecord, read_record, shard_dir, write_record
from retrieval.records import BuildSpec, CollectionInfo, DocumentCounts
from retrieval.stores.embedded.catalog import Catalog
from retrieval.stores.embedded.collection import EmbeddedCollection
from retrieval.sync import sync_documents

if TYPE_CHECKING:
    from rag.pipeline import Rag


@dataclass
class ShardIngest:
    """What one shard job did, and where its documents are."""

    report: IngestReport
    shard: int
    num_shards: int
    directory: Path | None  # the shard's data directory; None when it wrote into pgvector
    stats: dict[str, int]  # of the shard store, or of the shared pgvector collection
    seeded: DocumentCounts | None = None  # documents copied from the main collection before ingesting


def resolve_shard(shard: int | None, num_shards: int | None, env: Mapping[str, str]
                  ) -> tuple[int, int] | None:
    """This job's (shard, num_shards) from the options, else from a Slurm job array's variables.

    SLURM_ARRAY_TASK_ID counts from SLURM_ARRAY_TASK_MIN in steps of SLURM_ARRAY_TASK_STEP, so
    `--array=0-7` and `--array=1-8` both give shards 0..7 of 8. One shard is the whole corpus,
    so `--num-shards 1` turns sharding off (also inside an array job).

    Returns:
        None when the job is not sharded.

    Raises:
        ConfigError: a shard outside 0..N-1, one of the two missing, a Slurm variable that is not a number,
            or a Slurm array that is a list (--array=1,3,7) rather than a range.
    """
    if num_shards == 1 and shard in (None, 0):
        return None
    if shard is not None and num_shards is not None:
        # The options say it all: the array's variables do not matter (a list like --array=3,5 included).
        check_shard(shard, num_shards)
        return shard, num_shards
    env_shard, env_count = _slurm_task(env)
    n = num_shards if num_shards is not None else env_count
    if n is None:
        if shard is not None:
            raise ConfigError("--shard needs --num-shards N (the number of shard jobs), or run it as a "
                              "task of a Slurm job array")
        return None
    if n == 1 and shard in (None, 0):
        return None
    i = shard if shard is not None else env_shard
    if i is None:
        raise ConfigError("--num-shards needs --shard I (this job's shard, 0 to N-1), or run it as a task "
                          "of a Slurm job array")
    check_shard(i, n)
    return i, n


def check_shard(shard: int, num_shards: int) -> None:
    """Raises ConfigError unless 0 <= shard < num_shards."""
    if num_shards < 1:
        raise ConfigError(f"--num-shards must be at least 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ConfigError(
            f"shard {shard} is out of range for {num_shards} shards: use --shard 0 to {num_shards - 1} (a Slurm "
            f"array of {num_shards} tasks is --array=0-{num_shards - 1} or --array=1-{num_shards})")


def ingest_shard(rag: Rag, paths: Sequence[Path], collection: str | None, shard: int, num_shards: int,
                 progress: ProgressFn | None = None, allow_mass_delete: bool = False) -> ShardIngest:
    """Ingest shard `shard` of `num_shards` of the documents under `paths`.

    With pgvector the shard's documents go into the collection itself. With the embedded store
    they go into `<home>/shards/<collection>/<shard>-of-<num_shards>/`, which is first brought in
    line with the main collection (a copy of its vectors, not a re-embedding; with another
    embedder or chunking, with the collection's unfinished next version built that way, if any)
    unless it holds a run that was killed, which is resumed instead.

    Raises:
        ConfigError: a path does not exist or the shard is out of range.
        StoreError: pgvector, and the collection was built with another embedder or chunking.
        MassDeleteError: a root yields no sources while the collection holds documents under it,
            even if none of them hash to this shard (nothing is changed then).
    """
    check_shard(shard, num_shards)
    settings = rag.settings
    name = check_collection_name(collection or settings.collection)
    if settings.store == "pgvector":
        report = rag.ingest(paths, name, progress, shard=(shard, num_shards), allow_mass_delete=allow_mass_delete)
        return ShardIngest(report, shard, num_shards, None, rag.collection(name).stats())

    roots = scan_roots(paths)
    rag.load_ingest_embedder()
    embedder = rag.embedder
    # Built as one job with these settings would build the collection: if they differ from the
    # collection's, that job would write its next version, and the merge does the same.
    spec = rag.build_spec()
    record = ShardRecord(name, shard, num_shards, [str(r) for r in roots], spec.embedder, spec.fingerprint,
                         spec.dim, spec.chunking, run_id=uuid.uuid4().hex)
    live = rag.catalog.find_collection(name)
    source = _seed_source(rag.catalog, name, spec)
    guard = DeletionGuard(settings.max_delete_fraction, allow_mass_delete)
    # The empty-root check looks at the whole collection, before anything is written: this
    # shard's store holds only the documents that hash here, which may be none of a root's.
    whole = source or live
    if whole is not None:
        guard.check_roots(roots, rag.catalog.document_states(whole.name), has_sources)
    directory = shard_dir(settings.home, name, shard, num_shards)
    catalog, store = _open_shard_store(directory, record)
    try:
        _link_models(directory, settings.model_cache)
        previous = read_record(directory)
        seeded = None
        if previous is not None and previous.state == INGESTING and previous.paths == record.paths:
            # Killed mid-run: what it wrote is this run's own progress, keep it.
            record.run_id, record.started_at = previous.run_id, previous.started_at
        else:
            write_record(directory, record)  # "syncing": not mergeable until this run completes
            if source is not None:
                seeded = sync_documents(
                    rag.catalog, source.name, store,
                    lambda key: shard_of(key, num_shards) == shard and is_under_any(key, roots), progress)
        record.state = INGESTING
        write_record(directory, record)
        # The guard's fraction is of the whole collection's fair share per shard (this store holds only its part).
        live_documents = rag.catalog.collection_stats(live.name)["documents"] if live is not None else None
        report = run_ingest(settings, embedder, store, spec.chunking, roots, progress, guard=guard,
                            staging_path=directory / "staging.sqlite", shard=(shard, num_shards),
                            collection_documents=live_documents)
        record.state, record.finished_at, record.report = COMPLETE, time.time(), report.as_dict()
        write_record(directory, record)
        stats = store.stats()
    finally:
        catalog.close()
    return ShardIngest(report, shard, num_shards, directory, stats, seeded)


def _seed_source(catalog: Catalog, name: str, spec: BuildSpec) -> CollectionInfo | None:
    """What one job with `spec` would start from: the collection if built the same way, else the
    unfinished next version built that way (which it would resume); None means from scratch."""
    live = catalog.find_collection(name)
    if live is None or spec.matches(live):
        return live
    return next((h for h in catalog.hidden_generations(name) if h.generation > live.generation and spec.matches(h)),
                None)


def _slurm_task(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """(shard, count) of this Slurm array task, each None when unknown."""
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task is None:
        return None, None
    first = _env_int(env, "SLURM_ARRAY_TASK_MIN")
    first = 0 if first is None else first
    step = _env_int(env, "SLURM_ARRAY_TASK_STEP") or 1
    count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    last = _env_int(env, "SLURM_ARRAY_TASK_MAX")
    if count is None and last is not None:
        count = (last - first) // step + 1
    # A list (--array=1,3,7) sets MIN, MAX and COUNT but no position of this task in it: Slurm
    # reports STEP=1 there (checked on Slurm 22.05), so only a true range MIN, MIN+STEP, ..., MAX
    # of COUNT tasks maps task ids onto shards 0..COUNT-1 without gaps.
    not_a_range = (task - first) % step != 0 or (
        last is not None and count is not None and last - first != (count - 1) * step)
    if not_a_range:
        raise ConfigError(
            f"this Slurm job array is not a range (SLURM_ARRAY_TASK_MIN={first}, SLURM_ARRAY_TASK_MAX={last}, "
            f"SLURM_ARRAY_TASK_STEP={step}, SLURM_ARRAY_TASK_COUNT={count}): a list such as --array=1,3,7 gives a "
            f"task no shard number. Submit a range (--array=0-7, --array=1-8, --array=0-14:2; a %N throttle is "
            f"fine), or pass --shard I and --num-shards N yourself")
    return (task - first) // step, count


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number: unset it, or pass --shard and --num-shards") from None


def _open_shard_store(directory: Path, record: ShardRecord) -> tuple[Catalog, EmbeddedCollection]:
    """The shard's catalog and Faiss store, emptied first if they were built another way."""
    private_mkdir(directory)
    catalog = Catalog(directory / "catalog.sqlite")
    info = catalog.find_collection(record.collection)
    if info is not None and (info.fingerprint, info.dim, info.chunking) != (
            record.fingerprint, record.dim, record.chunking):
        # Built with another embedder or chunking: nothing in it can be reused or merged.
        catalog.close()
        shutil.rmtree(directory)
        private_mkdir(directory)
        catalog = Catalog(directory / "catalog.sqlite")
        info = None
    if info is None:
        info = catalog.create_collection(record.collection, record.embedder, record.fingerprint, record.dim,
                                         record.chunking)
    # Flat Faiss whatever the collection's kind: the merge reads vectors from the shard's catalog,
    # so an HNSW or IVF index here would be built only to be thrown away.
    collection = EmbeddedCollection(catalog, info, directory / "indexes", "faiss")
    collection.batch_writes = True  # a shard is written by its ingest job only
    return catalog, collection


def _link_models(directory: Path, model_cache: Path) -> None:
    """Share the main data directory's model cache, so `rag --home SHARD_DIR query` works too."""
    link = directory / "models"
    if link.exists() or link.is_symlink():
        return
    private_mkdir(model_cache)
    link.symlink_to(model_cache.resolve(), target_is_directory=True)
