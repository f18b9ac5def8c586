"""The RAG pipeline: retrieve (permission-filtered) → rerank → pack → generate.

`Rag` owns the catalog, the identity store and the models (loaded lazily, once), and is
what the CLI, the API and notebooks use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from ingest.pipeline import IngestPipeline, IngestReport, ProgressFn
from permissions.identity import IdentityStore
from permissions.models import Principal
from rag.errors import ConfigError
from rag.prompts import (
    build_messages,
    canonical_order,
    citations_for,
    is_repeating,
    select_sources,
    trim_repetition,
)
from rag.settings import Settings, check_collection_name
from rag.types import Answer
from retrieval.catalog import Catalog
from retrieval.index import CollectionIndex
from retrieval.retriever import Retriever, check_mode

if TYPE_CHECKING:
    from generation import LLM
    from ingest.embed import Embedder
    from retrieval.base import CollectionStore
    from retrieval.rerank import CrossEncoderReranker


NO_ANSWER = "I don't know: none of the documents you may read answer this question."


class Rag:
    """One data directory's collections, users and models."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        settings.home.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(settings.catalog_path)
        self.identity = IdentityStore(settings.catalog_path)
        self._indexes: dict[str, CollectionIndex] = {}
        self._lock = threading.Lock()
        self._generate_lock = threading.Lock()

    def close(self) -> None:
        if "embedder" in self.__dict__:  # stop its GPU worker processes, if any
            close_embedder = getattr(self.embedder, "close", None)
            if close_embedder is not None:
                close_embedder()
        self.catalog.close()
        for index in self._indexes.values():
            close = getattr(index, "close", None)
            if close is not None:
                close()
        self.identity.close()

    # -- models (lazy: a query with --no-generate never loads the generator) ------------

    @cached_property
    def embedder(self) -> Embedder:
        from ingest.embed import Embedder, EmbedderConfig

        devices = tuple(self.settings.embed_devices) if self.settings.embed_devices else None
        return Embedder(EmbedderConfig(model=self.settings.embedder, device=self.settings.device,
                                       batch_size=self.settings.embed_batch_size, dtype=self.settings.embed_dtype,
                                       devices=devices, max_batch_tokens=self.settings.embed_max_batch_tokens))

    @cached_property
    def reranker(self) -> CrossEncoderReranker:
        from retrieval.rerank import CrossEncoderReranker, resolve_reranker_dir

        path = resolve_reranker_dir(self.settings.reranker, self.settings.model_cache)
        return CrossEncoderReranker(path, device=self.settings.device)

    @cached_property
    def llm(self) -> LLM:
        from generation import LLM
        from generation.loader import resolve_model_dir

        path = resolve_model_dir(self.settings.generator, self.settings.model_cache)
        return LLM(path, device=self.settings.device)

    # -- collections ---------------------------------------------------------------------

    def index(self, collection: str | None = None, create: bool = False) -> CollectionStore:
        """A collection's store (NotFoundError if it does not exist and not `create`).

        The SQLite catalog + a Faiss/memory vector store, or PostgreSQL with pgvector when
        `settings.store == "pgvector"`. Without `create` this is always the live collection,
        the one queries read. With `create` (what ingest writes to), the collection is created
        if new; when this run's embedder or chunking settings differ from the collection's, it
        returns the collection's next version, built beside the live one and switched to when
        complete (`retrieval.rebuild.CollectionBuild`, `retrieval.stores.pg_rebuild`).
        """
        name = check_collection_name(collection or self.settings.collection)
        with self._lock:
            if name in self._indexes and not create:
                return self._indexes[name]
            spec = None
            if create:
                from ingest.chunk import ChunkingConfig
                from retrieval.rebuild import BuildSpec

                cfg = ChunkingConfig(self.settings.chunk_max_tokens, self.settings.chunk_overlap_tokens)
                spec = BuildSpec(self.embedder.name, self.embedder.fingerprint, self.embedder.dim,
                                 {"max_tokens": cfg.max_tokens, "overlap_tokens": cfg.overlap_tokens})
            if self.settings.store == "pgvector":
                from retrieval.stores import pgvector

                if spec is None:
                    if name not in self._indexes:
                        self._indexes[name] = pgvector.open_collection(self.dsn, name)
                    return self._indexes[name]
                from retrieval.stores import pg_rebuild

                target = pg_rebuild.open_for_ingest(self.dsn, name, spec)
                if isinstance(target, pgvector.PgCollection):
                    if name in self._indexes:  # keep the open one (its connection); same generation
                        target.close()
                        self._indexes[name].refresh()
                        return self._indexes[name]
                    self._indexes[name] = target
                return target

            def open_live() -> CollectionIndex:
                if name not in self._indexes:
                    self._indexes[name] = CollectionIndex(
                        self.catalog, self.catalog.get_collection(name), self.settings.index_dir,
                        self.settings.store)
                return self._indexes[name]

            if spec is None:
                return open_live()
            from retrieval.rebuild import open_for_ingest

            return open_for_ingest(self.catalog, name, spec, self.settings.index_dir, self.settings.store,
                                   open_live)

    @cached_property
    def dsn(self) -> str:
        """The PostgreSQL URL of the pgvector store: settings.dsn, else the local server."""
        if self.settings.dsn:
            return self.settings.dsn
        from rag.db import local_dsn

        dsn = local_dsn(self.settings.home)
        if dsn is None:
            raise ConfigError(
                "store is pgvector but no PostgreSQL server is configured: run `rag db start` "
                "for a local one, or pass --dsn postgresql://USER@HOST:PORT/DB (or set RAG_DSN)")
        return dsn

    def collection_names(self) -> list[str]:
        if self.settings.store == "pgvector":
            from retrieval.stores.pgvector import list_collections

            return sorted(list_collections(self.dsn))
        return self.catalog.collection_names()

    def ingest(self, paths: Sequence[Path], collection: str | None = None,
               progress: ProgressFn | None = None, shard: tuple[int, int] | None = None) -> IngestReport:
        """Bring a collection in line with the sources under `paths` (creating it if new).

        Args:
            shard: (index, count): write only the documents of this hash partition into the
                collection itself (pgvector, which takes concurrent writers); the embedded store
                shards into separate data directories instead (`ingest.shards.ingest_shard`).
        """
        from ingest.chunk import Chunker, ChunkingConfig

        index = self.index(collection, create=True)
        chunking = index.info.chunking
        chunker = Chunker(self.embedder.tokenizer,
                          ChunkingConfig(chunking["max_tokens"], chunking["overlap_tokens"]))
        return IngestPipeline(index, self.embedder.embed, chunker).run(paths, progress, shard=shard)

    # -- identity ------------------------------------------------------------------------

    def principal(self, user: str, groups: Sequence[str] = ()) -> Principal:
        return self.identity.principal_for(user, tuple(groups))

    # -- queries ---------------------------------------------------------------------------

    def retriever(self, collection: str | None = None, rerank: bool | None = None) -> Retriever:
        """A retriever over a collection; models are loaded only when they are used."""
        index = self.index(collection)  # first: an unknown collection fails before models load
        use_rerank = self.settings.rerank if rerank is None else rerank

        def embed_query(question: str):
            # Loaded only for the dense leg; a collection built with another embedder would
            # return nonsense (or fail on the dimension), so refuse it by name.
            if self.embedder.fingerprint != index.info.fingerprint:
                raise ConfigError(
                    f"collection {index.name!r} was built with embedder {index.info.embedder}, but this "
                    f"run uses {self.embedder.name}: set `embedder` to the collection's model, or use "
                    "--mode keyword, or re-ingest into a new collection")
            return self.embedder.embed_query(question)

        return Retriever(index, embed_query, self.reranker if use_rerank else None)

    def query(self, question: str, principal: Principal, collection: str | None = None,
              k: int | None = None, generate: bool = True, rerank: bool | None = None,
              mode: str | None = None) -> Answer:
        """Answer a question from what `principal` may read.

        Args:
            mode: retrieval legs, "dense", "keyword" or "hybrid" (default: settings.mode).

        Raises:
            ConfigError: empty question, bad k or unknown mode.
            NotFoundError: unknown collection.
        """
        answer, tokens = self._prepare(question, principal, collection, k, generate, rerank, mode)
        if tokens is not None:
            t = time.perf_counter()
            answer.text = trim_repetition(_collect_until_repeating(tokens))
            answer.timings["generate"] = time.perf_counter() - t
            answer.timings["total"] += answer.timings["generate"]
        return answer

    def stream(self, question: str, principal: Principal, collection: str | None = None,
               k: int | None = None, mode: str | None = None) -> tuple[Answer, Iterator[str]]:
        """Retrieval now, then an iterator of answer text pieces (generation is lazy)."""
        answer, tokens = self._prepare(question, principal, collection, k, True, None, mode)
        if tokens is None:  # nothing relevant: the fixed answer is the whole stream
            return answer, iter([answer.text or ""])
        return answer, tokens

    def _prepare(self, question: str, principal: Principal, collection: str | None,
                 k: int | None, generate: bool, rerank: bool | None, mode: str | None,
                 ) -> tuple[Answer, Iterator[str] | None]:
        question = (question or "").strip()
        if not question:
            raise ConfigError("empty question: ask something, e.g. `rag query \"Which GPU nodes can I use?\"`")
        k = k if k is not None else self.settings.top_k
        if not 1 <= k <= 100:
            raise ConfigError(f"k must be between 1 and 100, got {k}")
        total = time.perf_counter()
        retriever = self.retriever(collection, rerank)
        result = retriever.retrieve(question, principal, k=k,
                                    candidates=max(k, self.settings.candidates),
                                    rerank=retriever.reranker is not None,
                                    mode=check_mode(mode or self.settings.mode))
        timings = dict(result.timings)
        answer = Answer(question=question, text=None, citations=[], hits=result.hits,
                        timings=timings)
        if not generate:
            answer.citations = citations_for(canonical_order(result.hits))
            timings["total"] = time.perf_counter() - total
            return answer, None
        relevant = result.hits
        floor = self.settings.min_rerank_score
        if retriever.reranker is not None and floor is not None:
            relevant = [h for h in result.hits if h.score >= floor]
        if not relevant:
            # Nothing the user may read is about this: say so rather than let a model guess.
            answer.text = NO_ANSWER
            timings["total"] = time.perf_counter() - total
            return answer, None
        t = time.perf_counter()
        llm = self.llm
        timings["load_generator"] = time.perf_counter() - t
        sources = canonical_order(select_sources(
            relevant, lambda s: len(llm.tokenizer.encode(s)), self.settings.context_tokens))
        answer.citations = citations_for(sources)
        messages = build_messages(question, sources)
        timings["total"] = time.perf_counter() - total
        return answer, self._generate(messages)

    def _generate(self, messages: list[dict[str, str]]) -> Iterator[str]:
        from generation import SamplingParams

        params = SamplingParams(temperature=self.settings.temperature,
                                max_tokens=self.settings.max_new_tokens)
        prompt = self.llm.apply_chat_template(messages)
        # The simple generator is not thread-safe; one generation at a time.
        with self._generate_lock:
            yield from self.llm.stream(prompt, params)


def _collect_until_repeating(tokens: Iterator[str]) -> str:
    """Join streamed pieces, stopping the generator once the answer loops on itself.

    Closing the stream aborts the request, so a small model stuck in a loop does not burn
    the rest of max_new_tokens on text that would be trimmed anyway.
    """
    text = ""
    try:
        for piece in tokens:
            text += piece
            if any(c in piece for c in ".!?\n") and is_repeating(text):
                break
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
    return text
