"""One ingest run with the settings' knobs: the pipeline that `Rag.ingest` and a Slurm shard job both run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ingest.chunk import Chunker, ChunkingConfig
from ingest.deletion_guard import DeletionGuard
from ingest.embed.embedder import Embedder, ingest_batch_chunks
from ingest.pipeline import IngestPipeline, IngestReport, ProgressFn
from ingest.source_names import SourceNamer
from rag.settings import Settings, ingest_worker_count
from retrieval.base import CollectionStore


def run_ingest(settings: Settings, embedder: Embedder, store: CollectionStore, chunking: dict[str, Any],
               paths: Sequence[Path], progress: ProgressFn | None, *, guard: DeletionGuard, staging_path: Path,
               shard: tuple[int, int] | None = None, collection_documents: int | None = None) -> IngestReport:
    """Bring `store` in line with the sources under `paths` (`IngestPipeline.run`), chunked as `chunking`.

    With the model in a worker process the report also has the stage "embed_in_worker": the seconds
    the worker spent embedding, against "embed", the calls' round trips (the difference is transfer
    and waiting).
    """
    chunker = Chunker(embedder.tokenizer, ChunkingConfig.from_dict(chunking),
                      batched=settings.ingest_chunk_batch > 1)
    # A worker process runs the model: the embed thread here needs no quick GIL hand-overs.
    switch_ms = settings.ingest_switch_interval_ms if embedder.launches_here else 0.0
    pipeline = IngestPipeline(store, embedder.embed, chunker, namer=SourceNamer(settings.source_urls), guard=guard,
                              batch_chunks=ingest_batch_chunks(embedder.device, settings.ingest_batch_chunks),
                              max_document_bytes=settings.max_document_bytes, staging_path=staging_path,
                              chunk_batch=settings.ingest_chunk_batch,
                              workers=ingest_worker_count(settings.ingest_workers),
                              overlap_embedding=settings.ingest_overlap_embedding,
                              write_behind=settings.ingest_write_behind, switch_interval_ms=switch_ms,
                              embed_ready=embedder.wait_ready)
    worker_before = embedder.worker_seconds
    report = pipeline.run(paths, progress, shard=shard, collection_documents=collection_documents)
    if not embedder.launches_here:
        report.seconds["embed_in_worker"] = embedder.worker_seconds - worker_before
    return report
