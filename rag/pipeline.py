"""The RAG pipeline: retrieve (permission-filtered) → rerank → pack → generate.

`Rag` owns the catalog, the identity store and the models (loaded lazily, once), and is
what the CLI, the API and notebooks use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import os
import time
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ingest.deletion_guard import DeletionGuard
from ingest.pipeline import IngestReport, ProgressFn
from permissions.models import Principal
from rag.admission import AdmissionControl
from rag.answer_mode import AnswerMode, resolve_answer_mode
from rag.answering import AnswerDone, PreparedAnswer, answer_events
from rag.batching import BatchedQueryEmbedder, BatchedReranker
from rag.conversation import retrieval_query_for
from rag.errors import ConfigError, NotFoundError
from rag.extractive import extract_answer
from rag.generator import SHARED_NAMESPACE, CacheSegment, GenerationParams, GenerationRequest, Generator, TextDelta
from rag.identity_backend import open_identity, store_dsn
from rag.ingest_lock import exclusive_ingest
from rag.loop_thread import LoopThread
from rag.private_files import ensure_private_dir
from rag.prompts import Prompt, build_prompt, canonical_order, citations_for, select_sources, source_tokens
from rag.settings import (
    MAX_CANDIDATES,
    Settings,
    check_collection_name,
    check_max_hits_per_document,
    ingest_worker_count,
)
from rag.source_order import order_sources
from rag.types import Answer, Hit
from retrieval.records import BuildSpec
from retrieval.retriever import Retriever, check_mode
from retrieval.second_chunks import reading_parts, with_second_chunks
from retrieval.stores import CollectionStores
from retrieval.stores.embedded.catalog import Catalog

if TYPE_CHECKING:
    from ingest.embed.embedder import Embedder, EmbedderConfig
    from retrieval.base import CollectionStore
    from retrieval.rerank import CrossEncoderReranker


NO_ANSWER = "I don't know: none of the documents you may read answer this question."


class Rag:
    """One data directory's collections, users and models."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        ensure_private_dir(settings.home, fix=settings.home_permissions == "fix")
        self.catalog = Catalog(settings.catalog_path)
        # The data directory's SQLite, or with store = pgvector the database every replica shares.
        self.identity = open_identity(settings, lambda: self.dsn)
        # faiss_gpu "on" without faiss-gpu fails here, with the install hint; the setting is this
        # Rag's own (another Rag in the process may choose otherwise).
        self.stores = CollectionStores(settings.store, lambda: self.catalog, settings.index_dir, lambda: self.dsn,
                                       faiss_gpu=settings.faiss_gpu,
                                       pg_tuning={"index_memory_mb": settings.pg_index_memory_mb,
                                                  "hnsw_m": settings.pg_hnsw_m,
                                                  "hnsw_ef_construction": settings.pg_hnsw_ef_construction})

    async def aclose_generator(self) -> None:
        """Stop the generator from the event loop that used it (the API's lifespan calls this)."""
        generator = self.__dict__.pop("generator", None)
        if generator is not None:
            await generator.aclose()

    def close(self) -> None:
        for name in ("query_embedder", "batched_reranker"):
            if name in self.__dict__:
                self.__dict__[name].close()
        if "generator" in self.__dict__:
            loop = self.__dict__.get("_loop")
            if loop is not None:
                loop.run(self.generator.aclose())
            else:
                asyncio.run(self.generator.aclose())
        if "_loop" in self.__dict__:
            self._loop.close()
        if "embedder" in self.__dict__:  # stop its GPU worker processes, if any
            close_embedder = getattr(self.embedder, "close", None)
            if close_embedder is not None:
                close_embedder()
        self.catalog.close()
        self.stores.close()
        self.identity.close()

    # -- models (lazy: a query with --no-generate never loads the generator) ------------

    @cached_property
    def embedder(self) -> Embedder:
        from ingest.embed.embedder import Embedder

        return Embedder(self._embedder_config())

    def _embedder_config(self) -> EmbedderConfig:
        from ingest.embed.embedder import EmbedderConfig
        from ingest.embed.packaged_bge import resolve_embedder_dir

        devices = tuple(self.settings.embed_devices) if self.settings.embed_devices else None
        model = resolve_embedder_dir(self.settings.embedder, self.settings.model_cache)  # "bge-small-en": converted
        return EmbedderConfig(model=model, device=self.settings.device,
                              batch_size=self.settings.embed_batch_size, dtype=self.settings.embed_dtype,
                              devices=devices, max_batch_tokens=self.settings.embed_max_batch_tokens)

    def load_ingest_embedder(self) -> None:
        """Load the embedder for an ingest: in a worker process where `ingest_embed_process` says
        so (by default where it runs on a GPU). An embedder this object loaded before stays."""
        if "embedder" in self.__dict__:
            return
        from ingest.embed.embedder import Embedder, picks_gpu

        config = self._embedder_config()
        in_worker = self.settings.ingest_embed_process
        if in_worker is None:
            in_worker = picks_gpu(config)
        self.__dict__["embedder"] = Embedder(dataclasses.replace(config, in_worker=in_worker))

    @cached_property
    def reranker(self) -> CrossEncoderReranker:
        from retrieval.rerank import CrossEncoderReranker, resolve_reranker_dir

        path = resolve_reranker_dir(self.settings.reranker, self.settings.model_cache)
        return CrossEncoderReranker(path, device=self.settings.device, dtype=self.settings.rerank_dtype)

    # -- collections ---------------------------------------------------------------------

    def collection(self, name: str | None = None, create: bool = False) -> CollectionStore:
        """A collection's store (NotFoundError if it does not exist and not `create`).

        The backend is the `store` setting's (`retrieval.stores.CollectionStores`). Without
        `create` this is always the live collection, the one queries read. With `create` (what
        ingest writes to), the collection is created if new; when this run's embedder or
        chunking settings differ from the collection's, it returns the collection's next
        version, built beside the live one and switched to by its `finish()` when complete
        (`retrieval.rebuild`).
        """
        name = check_collection_name(name or self.settings.collection)
        if not create:
            return self.stores.open(name)
        return self.stores.for_ingest(name, self.build_spec())

    def build_spec(self) -> BuildSpec:
        """What an ingest with these settings builds a collection with: embedder and chunking."""
        from ingest.chunk import ChunkingConfig

        cfg = ChunkingConfig(self.settings.chunk_max_tokens, self.settings.chunk_overlap_tokens,
                             self.settings.chunk_title_context)
        return BuildSpec(self.embedder.name, self.embedder.fingerprint, self.embedder.dim, cfg.as_dict())

    @cached_property
    def dsn(self) -> str:
        """The PostgreSQL URL of the pgvector store: settings.dsn, else the local server."""
        return store_dsn(self.settings)

    def collection_names(self) -> list[str]:
        return self.stores.names()

    def ingest(self, paths: Sequence[Path], collection: str | None = None,
               progress: ProgressFn | bool | None = None, shard: tuple[int, int] | None = None,
               allow_mass_delete: bool = False) -> IngestReport:
        """Bring a collection in line with the sources under `paths` (creating it if new).

        Args:
            progress: None (default): our progress bars in a terminal or a notebook, nothing
                when output goes to a log or a pipe; True/False: bars on/off; or your own
                ProgressFn, called with (stage, done, total).
            shard: (index, count): write only the documents of this hash partition into the
                collection itself (pgvector, which takes concurrent writers); the embedded store
                shards into separate data directories instead (`rag.shards.run.ingest_shard`).
            allow_mass_delete: delete whatever is gone, past `max_delete_fraction` of the
                collection and under roots that yield nothing (see ingest/deletion_guard.py).
        """
        from rag.progress import IngestProgress, show_progress

        if callable(progress) or not show_progress(progress):
            return self._ingest(paths, collection, progress if callable(progress) else None, shard,
                                allow_mass_delete)
        with IngestProgress(enabled=True) as bar:  # its "loading models" line covers the embedder load
            return self._ingest(paths, collection, bar.update, shard, allow_mass_delete)

    def _ingest(self, paths: Sequence[Path], collection: str | None, progress: ProgressFn | None,
                shard: tuple[int, int] | None, allow_mass_delete: bool) -> IngestReport:
        from rag.ingest_run import run_ingest

        if ingest_worker_count(self.settings.ingest_workers) > 1:
            from ingest.parse_pool import start_forkserver

            start_forkserver()  # the parse workers' warm-up runs beside the embedder's load below
        self.load_ingest_embedder()
        store = self.collection(collection, create=True)
        # Chunks of a document spanning several embed batches wait here (ingest/staging.py).
        staging = self.settings.home / "staging" / (
            f"{store.name}.sqlite" if shard is None else f"{store.name}.shard{shard[0]}of{shard[1]}.sqlite")
        ensure_private_dir(staging.parent)
        # One ingest of this collection (or shard) at a time: another process's would share the
        # staging file and, embedded, overwrite this one's index (rag/ingest_lock.py).
        with exclusive_ingest(staging.with_name(staging.name + ".lock"), f"collection {store.name!r}"):
            store.refresh()  # what a previous holder wrote
            guard = DeletionGuard(self.settings.max_delete_fraction, allow_mass_delete)
            return run_ingest(self.settings, self.embedder, store, store.info.chunking, paths, progress,
                              guard=guard, staging_path=staging, shard=shard)

    def readable_collections(self, principal: Principal) -> list[str]:
        """Collections in which `principal` may read at least one chunk (others stay unnamed)."""
        return [name for name in self.collection_names() if self.can_read_collection(name, principal)]

    def can_read_collection(self, name: str, principal: Principal) -> bool:
        """Whether the collection exists and `principal` may read something in it (one answer for both)."""
        from permissions.policy import store_filter

        try:
            store = self.collection(name)
        except (NotFoundError, ConfigError):
            return False
        store.refresh()
        # An exact search with a zero query returns any readable chunk, and nothing else: the ACL
        # filter runs inside it as for every query.
        return bool(store.search(_zero_query(store.info.dim), 1, sorted(store_filter(principal)), exact=True))

    def readable_chunk(self, collection: str, chunk_id: int, principal: Principal):
        """The chunk record if it exists and `principal` may read it, else None (never says which)."""
        return self.readable_chunks(collection, [chunk_id], principal)[0]

    def readable_chunks(self, collection: str, chunk_ids: Sequence[int], principal: Principal) -> list:
        """Each chunk's record if it exists and `principal` may read it, else None, in order (one read)."""
        try:
            store = self.collection(collection)
        except (NotFoundError, ConfigError):
            return [None] * len(chunk_ids)
        store.refresh()
        records = store.chunk_records(list(chunk_ids))
        return [r if r is not None and principal.can_read(r.acl) else None
                for r in (records.get(i) for i in chunk_ids)]

    # -- identity ------------------------------------------------------------------------

    def principal(self, user: str, groups: Sequence[str] = ()) -> Principal:
        return self.identity.principal_for(user, tuple(groups))

    # -- queries ---------------------------------------------------------------------------

    def retriever(self, collection: str | None = None, rerank: bool | None = None, *,
                  max_hits_per_document: int | None = None, dense_feedback: bool | None = None,
                  page_evidence: float | None = None) -> Retriever:
        """A retriever over a collection; models are loaded only when they are used.

        Query embeddings and rerank pairs of concurrent queries (the API runs each in its own
        thread) are batched into shared forward passes. `max_hits_per_document` (0: no cap),
        `dense_feedback` and `page_evidence` override the settings of the same names for this
        retriever (None: the setting).
        """
        store = self.collection(collection)  # first: an unknown collection fails before models load
        use_rerank = self.settings.rerank if rerank is None else rerank

        def embed_query(question: str):
            # Loaded only for the dense leg; a collection built with another embedder would
            # return nonsense (or fail on the dimension), so refuse it by name.
            if self.embedder.fingerprint != store.info.fingerprint:
                raise ConfigError(
                    f"collection {store.name!r} was built with embedder {store.info.embedder}, but this "
                    f"run uses {self.embedder.name}: set `embedder` to the collection's model, or use "
                    "--mode keyword, or re-ingest into a new collection")
            return self.query_embedder(question)

        def embed_passages(texts: Sequence[str]) -> np.ndarray:
            # The query embedder runs the embedder's plain batch function, the one ingest embeds
            # chunks with, so feedback passages land where their stored vectors are; all of them
            # in one forward pass, not one each. (The dense leg's embed_query, which checks the
            # collection's embedder, has run before any feedback.)
            return self.query_embedder.many(texts)

        if max_hits_per_document is None:
            max_hits_per_document = self.settings.max_hits_per_document
        else:  # checked here, in the caller's words: the retriever's error names its own argument
            check_max_hits_per_document(max_hits_per_document)
        return Retriever(store, embed_query, self.batched_reranker if use_rerank else None,
                         max_per_document=max_hits_per_document or None,  # 0: no cap
                         fuse_rerank=self.settings.fuse_rerank, embed_passages=embed_passages,
                         dense_feedback=self.settings.dense_feedback if dense_feedback is None else dense_feedback,
                         page_evidence=self.settings.page_evidence if page_evidence is None else page_evidence)

    @cached_property
    def query_embedder(self) -> BatchedQueryEmbedder:
        # On a CPU each text gets a pass of its own: a user's vector depends on nothing another
        # user asked (BatchedQueryEmbedder); on a GPU concurrent questions share one pass.
        return BatchedQueryEmbedder(self.embedder.embed, query_prompt=self.embedder.query_prompt,
                                    one_per_pass=str(self.embedder.device) == "cpu")

    @cached_property
    def batched_reranker(self) -> BatchedReranker:
        return BatchedReranker(self.reranker)

    # -- generation --------------------------------------------------------------------------

    @cached_property
    def generator(self) -> Generator:
        """The generator the settings name: our engine in this process, or a remote server."""
        if self.settings.generator_backend == "remote":
            from rag.generators.remote import make_remote_generator

            return make_remote_generator(self.settings)
        from generation.loader import resolve_model_dir
        from rag.generators.local import LocalGenerator

        path = resolve_model_dir(self.settings.generator, self.settings.model_cache)
        return LocalGenerator(path, device=self.settings.device, max_num_seqs=self.settings.engine_max_num_seqs,
                              num_kv_blocks=self.settings.engine_num_kv_blocks,
                              kv_reuse=self.settings.engine_kv_reuse,
                              host_kv_blocks=self.settings.engine_host_kv_blocks,
                              quantization=self.settings.engine_quantization,
                              kv_cache_dtype=self.settings.engine_kv_cache_dtype,
                              switch_interval_ms=self.settings.engine_switch_interval_ms,
                              max_num_batched_tokens=self.settings.engine_max_num_batched_tokens)

    @cached_property
    def admission(self) -> AdmissionControl:
        return AdmissionControl(self.settings.max_concurrent_generations, self.settings.max_queued_generations)

    @cached_property
    def _loop(self) -> LoopThread:
        return LoopThread()

    # -- queries ---------------------------------------------------------------------------

    def query(self, question: str, principal: Principal, collection: str | None = None,
              k: int | None = None, generate: bool = True, rerank: bool | None = None,
              mode: str | None = None, history: Sequence[dict[str, str]] = (),
              candidates: int | None = None, *, max_hits_per_document: int | None = None,
              dense_feedback: bool | None = None, page_evidence: float | None = None) -> Answer:
        """Answer a question from what `principal` may read.

        Args:
            mode: retrieval legs, "dense", "keyword" or "hybrid" (default: settings.mode).
            history: earlier turns of a conversation ({"role", "content"}), kept in the prompt.
            candidates: hits each retrieval leg hands to the reranker, 1..MAX_CANDIDATES
                (default: settings.candidates); at least k are fetched either way.
            max_hits_per_document, dense_feedback, page_evidence: this query's values of the
                settings of the same names (None: the settings'); see `retriever`.

        Raises:
            ConfigError: empty question, bad k or candidates, or unknown mode.
            NotFoundError: unknown collection.
            OverloadedError: every generation slot is taken and the queue is full.
        """
        return self._loop.run(self.aquery(question, principal, collection, k, generate, rerank, mode, history,
                                          candidates, max_hits_per_document=max_hits_per_document,
                                          dense_feedback=dense_feedback, page_evidence=page_evidence))

    async def aquery(self, question: str, principal: Principal, collection: str | None = None,
                     k: int | None = None, generate: bool = True, rerank: bool | None = None,
                     mode: str | None = None, history: Sequence[dict[str, str]] = (),
                     candidates: int | None = None, *, max_hits_per_document: int | None = None,
                     dense_feedback: bool | None = None, page_evidence: float | None = None) -> Answer:
        """`query` for async callers: retrieval runs in a worker thread, generation is batched."""
        prepared = await self.aprepare(question, principal, collection, k, generate, rerank, mode, history,
                                       candidates=candidates, max_hits_per_document=max_hits_per_document,
                                       dense_feedback=dense_feedback, page_evidence=page_evidence)
        async for event in self.answer_events(prepared):
            if isinstance(event, AnswerDone):
                return event.answer
        raise AssertionError("answer_events ended without AnswerDone")

    def stream(self, question: str, principal: Principal, collection: str | None = None,
               k: int | None = None, mode: str | None = None,
               candidates: int | None = None) -> tuple[Answer, Iterator[str]]:
        """Retrieval now, then an iterator of answer text pieces (generation is lazy)."""
        prepared = self._loop.run(self.aprepare(question, principal, collection, k, True, None, mode,
                                                candidates=candidates))

        def pieces() -> Iterator[str]:
            for event in self._loop.iterate(self.answer_events(prepared)):
                if isinstance(event, TextDelta):
                    yield event.text

        return prepared.answer, pieces()

    def answer_events(self, prepared: PreparedAnswer, deadline: float | None = None):
        """The answer's text deltas, then AnswerDone (see rag.answering.answer_events)."""
        generator = self.generator if prepared.request is not None else None
        return answer_events(prepared, generator, self.admission, deadline)

    async def aprepare(self, question: str, principal: Principal, collection: str | None = None,
                       k: int | None = None, generate: bool = True, rerank: bool | None = None,
                       mode: str | None = None, history: Sequence[dict[str, str]] = (),
                       retrieval_query: str | None = None, candidates: int | None = None, *,
                       max_hits_per_document: int | None = None,
                       dense_feedback: bool | None = None, page_evidence: float | None = None) -> PreparedAnswer:
        """Retrieve (in a worker thread: embedding, search and rerank stay off the event loop)."""
        return await asyncio.to_thread(self.prepare, question, principal, collection, k, generate, rerank,
                                       mode, history, retrieval_query, candidates,
                                       max_hits_per_document=max_hits_per_document, dense_feedback=dense_feedback,
                                       page_evidence=page_evidence)

    def prepare(self, question: str, principal: Principal, collection: str | None = None,
                k: int | None = None, generate: bool = True, rerank: bool | None = None,
                mode: str | None = None, history: Sequence[dict[str, str]] = (),
                retrieval_query: str | None = None, candidates: int | None = None, *,
                max_hits_per_document: int | None = None, dense_feedback: bool | None = None,
                page_evidence: float | None = None) -> PreparedAnswer:
        """Retrieve and pack the prompt; the returned PreparedAnswer says what to generate.

        Args:
            retrieval_query: what to search with, when it differs from the question. None: the
                question, or with `history`, a short or referring follow-up together with the
                user turn before it (`rag.conversation.retrieval_query_for`).
            candidates: hits per retrieval leg for the reranker (see `query`).
            max_hits_per_document, dense_feedback, page_evidence: see `query`.
        """
        started = time.perf_counter()
        question = (question or "").strip()
        if not question:
            raise ConfigError("empty question: ask something, e.g. `rag query \"Which GPU nodes can I use?\"`")
        k = k if k is not None else self.settings.top_k
        if not 1 <= k <= 100:
            raise ConfigError(f"k must be between 1 and 100, got {k}")
        candidates = check_candidates(self.settings.candidates if candidates is None else candidates)
        self.collection(collection)  # an unknown collection fails before any model loads
        mode = check_mode(mode or self.settings.mode)
        timings = self._load_retrieval_models(dense=mode != "keyword",
                                              rerank=self.settings.rerank if rerank is None else rerank)
        retriever = self.retriever(collection, rerank, max_hits_per_document=max_hits_per_document,
                                   dense_feedback=dense_feedback, page_evidence=page_evidence)
        reranked = retriever.reranker is not None
        if retrieval_query is None and history:
            retrieval_query = retrieval_query_for(question, history)  # as the chat API searches a follow-up
        result = retriever.retrieve(retrieval_query or question, principal, k=k,
                                    candidates=max(k, candidates),
                                    rerank=reranked, mode=mode)
        timings |= result.timings
        answer = Answer(question=question, text=None, citations=[], hits=result.hits, timings=timings)
        if not generate:
            answer.citations = citations_for(canonical_order(result.hits), result.hits, reranked)
            return PreparedAnswer(answer, None, started)
        relevant = result.hits
        floor = self.settings.min_rerank_score
        if retriever.reranker is not None and floor is not None:
            relevant = [h for h in result.hits if h.score >= floor]
        if not relevant:
            # Nothing the user may read is about this: say so rather than let a model guess.
            answer.text = NO_ANSWER
            return PreparedAnswer(answer, None, started)
        # With one hit per page, each source is read with its page's next-best candidate chunk
        # when that chunk earned it (retrieval.second_chunks): one citation, the two chunks that
        # most often hold the answer together.
        if self.answer_mode == "extract":
            return self._prepare_extract(answer, relevant, result.hits, reranked, retrieval_query, started,
                                         result.seconds)
        t = time.perf_counter()
        generator = self.generator
        timings["load_generator"] = time.perf_counter() - t
        params = GenerationParams(max_tokens=self.settings.max_new_tokens, temperature=self.settings.temperature)

        def request_for(order: list[Hit]) -> GenerationRequest:
            prompt = build_prompt(question, order, history)
            return GenerationRequest(messages=prompt.messages, params=params,
                                     segments=self.cache_segments(prompt, order, principal),
                                     user_salt=self.user_salt(principal))

        ranked = select_sources(relevant, generator.count_tokens, self.settings.context_tokens)
        # Second chunks take only what the sources leave of the budget (as select_sources counts).
        ranked = with_second_chunks(ranked, result.seconds, lambda h: source_tokens(h, generator.count_tokens),
                                    self.settings.context_tokens)
        sources = order_sources(ranked, generator, request_for)  # the cached prefix first (rag.source_order)
        answer.citations = citations_for(sources, result.hits, reranked)
        return PreparedAnswer(answer, request_for(sources), started)

    @cached_property
    def answer_mode(self) -> AnswerMode:
        """How this Rag writes answers: "extract" or "generate" (settings.answer_mode, "auto" decided)."""
        return resolve_answer_mode(self.settings)

    def _prepare_extract(self, answer: Answer, relevant: list[Hit], ranked: list[Hit], reranked: bool,
                         retrieval_query: str | None, started: float,
                         seconds: dict[int, Hit]) -> PreparedAnswer:
        """The answer quoted from the relevant sources (rag/extractive.py); the generator is never loaded.

        Only `relevant` is read, with their second chunks (`seconds`): hits the retriever
        post-checked against the principal's ACL.
        """
        timings = answer.timings
        if "load_reranker" not in timings:  # retrieval skipped the cross-encoder; extraction needs it
            t = time.perf_counter()
            self.batched_reranker  # noqa: B018 - loads the cross-encoder, timed apart from the work
            timings["load_reranker"] = time.perf_counter() - t
        scorer = self.batched_reranker
        sources = canonical_order(relevant)  # the order of retrieval-only answers and remote prompts
        # Each chunk is read with its own heading; citations show the joined text.
        parts = [reading_parts(h, seconds) for h in sources]
        sources = with_second_chunks(sources, seconds)
        answer.citations = citations_for(sources, ranked, reranked)
        t = time.perf_counter()
        # A follow-up ("and how do I book it?") is scored with the turn before it, as it was searched.
        # Reranked hits carry the cross-encoder's logit of the whole source (the source floor
        # reads it); unreranked ones are scored with the sentences, in one batch.
        text = extract_answer(retrieval_query or answer.question, sources,
                              lambda query, passages: scorer.batcher((query, passages)),
                              source_scores=[h.score for h in sources] if reranked else None, parts=parts)
        timings["extract"] = time.perf_counter() - t
        answer.text = text or NO_ANSWER
        return PreparedAnswer(answer, None, started)

    def _load_retrieval_models(self, dense: bool, rerank: bool) -> dict[str, float]:
        """Load the models this query uses, timed apart from the work (`rag query` says when loading dominates).

        After the first query they are loaded, and each time is ~0 (a long-running `rag serve`).
        """
        timings: dict[str, float] = {}
        # The properties the retriever calls, so that whatever stands in for a model is what loads.
        for key, attribute, needed in (("load_embedder", "query_embedder", dense),
                                       ("load_reranker", "batched_reranker", rerank)):
            if needed:
                t = time.perf_counter()
                getattr(self, attribute)
                timings[key] = time.perf_counter() - t
        return timings

    # -- prefix-cache namespaces -------------------------------------------------------------

    def cache_segments(self, prompt: Prompt, sources: Sequence[Hit], principal: Principal) -> list[CacheSegment]:
        """Every part of the user turn with its namespace (rag.prompts, rag.prompt_layout).

        The head is shared; a source's label and chunk are in its ACL's namespace (the label is
        only a citation number, and in the user's namespace it would end cross-user sharing of
        every chunk after it, since a block's hash chains all blocks before it); the history
        and question are the user's. The first label ("[1]", right after the head) is shared
        like the head: it follows nothing but the head, so it reveals nothing of any source, and
        with it the head ends where every chunk's reusable KV starts (`rag.prompt_layout`).
        """
        user = self.user_salt(principal)
        segments = []
        for part in prompt.parts:
            if part.kind == "label" and part.source == 0:
                segments.append(CacheSegment(part.text, SHARED_NAMESPACE, "label"))
            elif part.kind in ("label", "chunk"):
                segments.append(CacheSegment(part.text, acl_namespace(sources[part.source].acl), part.kind))
            else:
                segments.append(CacheSegment(part.text, SHARED_NAMESPACE if part.kind == "head" else user))
        return segments

    def user_salt(self, principal: Principal) -> str:
        """A per-user cache salt that no client can choose or predict (keyed by a per-process secret)."""
        digest = hmac.new(self._salt_key, principal.user.encode(), hashlib.sha256).hexdigest()[:32]
        return f"user:{digest}"

    @cached_property
    def _salt_key(self) -> bytes:
        return os.urandom(32)


def check_candidates(candidates: object) -> int:
    """`candidates` if it is a whole number in 1..MAX_CANDIDATES, else ConfigError saying so."""
    # bool is an int in Python: candidates=True would quietly mean 1.
    if isinstance(candidates, bool) or not isinstance(candidates, int) or not 1 <= candidates <= MAX_CANDIDATES:
        raise ConfigError(f"candidates must be a whole number between 1 and {MAX_CANDIDATES} (hits handed to the "
                          f"reranker per retrieval leg), got {candidates!r}")
    return candidates


def acl_namespace(acl: frozenset[str]) -> str:
    """The cache namespace of text readable by exactly `acl` (sources with equal ACLs share KV)."""
    return "acl:" + hashlib.sha256("\x00".join(sorted(acl)).encode()).hexdigest()[:32]


def _zero_query(dim: int):
    import numpy as np

    return np.zeros(dim, dtype=np.float32)
