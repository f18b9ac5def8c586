"""Micro-batching: concurrent query embeddings and rerank pairs share one forward pass.

Retrieval runs in worker threads (off the event loop), one per request. Each thread hands its
work to a `MicroBatcher` and blocks; one worker thread runs everything queued so far as a single
batch. Nothing waits for a batch to fill: at concurrency 1 a call runs at once, and under load
the calls that arrive while a batch runs form the next one (batches grow with the load).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from rag.errors import ConfigError
from rag.types import Hit

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class BatchStats:
    """How much batching happened (for tests and metrics)."""

    num_calls: int = 0
    num_batches: int = 0
    max_batch: int = 0


class MicroBatcher(Generic[T, R]):
    """Runs `run_batch` over the items of concurrent callers, one batch at a time.

    Args:
        run_batch: maps a list of items to a list of results of the same length.
        max_batch: most items per call of run_batch.
        name: the worker thread's name.
    """

    def __init__(self, run_batch: Callable[[list[T]], Sequence[R]], max_batch: int = 64,
                 name: str = "micro-batcher") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._cv = threading.Condition()
        self._pending: list[tuple[T, Future[R]]] = []
        self._closed = False
        self.stats = BatchStats()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def __call__(self, item: T) -> R:
        """The result for one item (blocks until its batch has run; re-raises its error)."""
        return self.many([item])[0]

    def many(self, items: Sequence[T]) -> list[R]:
        """The results for several items of one caller, queued together so they share a batch."""
        futures: list[Future[R]] = [Future() for _ in items]
        with self._cv:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._pending += zip(items, futures, strict=True)
            self.stats.num_calls += len(futures)
            self._cv.notify()
        return [future.result() for future in futures]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed and not self._pending:
                    return
                batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
                self.stats.num_batches += 1
                self.stats.max_batch = max(self.stats.max_batch, len(batch))
            try:
                results = self._run_batch([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(batch)} items")
            except BaseException as exc:  # noqa: BLE001 - every caller of this batch must hear of it
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                future.set_result(result)


class BatchedQueryEmbedder:
    """`embed_query` whose concurrent calls are embedded together.

    Args:
        embed: the embedder's batch function (texts → (n, dim) float32 rows), the one passages
            were embedded with.
        query_prompt: put before each question (not before `many`'s passages): the model's
            query instruction (Embedder.query_prompt; BGE's), "" for models without one.
        one_per_pass: embed every text in a forward pass of its own (the service sets it on a
            CPU). Batched with another user's longer text, a question is padded and its rows go
            through matmuls of another shape, and its vector moves by ~1e-7: a user's ranking
            would then depend, however slightly, on what someone else asked at the same moment.
            The cross-encoder scores one pair per pass on a CPU for the same reason. A text is
            still queued behind the others, so there is one model call at a time.
    """

    def __init__(self, embed: Callable[[list[str]], np.ndarray], max_batch: int = 64, query_prompt: str = "",
                 one_per_pass: bool = False) -> None:
        def run(texts: list[str]) -> list[np.ndarray]:
            if one_per_pass:
                return [embed([text])[0] for text in texts]
            return list(embed(texts))

        self.batcher: MicroBatcher[str, np.ndarray] = MicroBatcher(run, max_batch, name="query-embed-batcher")
        self.query_prompt = query_prompt
        self.one_per_pass = one_per_pass

    def __call__(self, question: str) -> np.ndarray:
        return self.batcher(self.query_prompt + question)

    def many(self, texts: Sequence[str]) -> np.ndarray:
        """(n, dim) rows for several texts, embedded in one pass (with whatever else is queued)."""
        return np.stack(self.batcher.many(texts))

    def close(self) -> None:
        self.batcher.close()


class BatchedReranker:
    """A Reranker whose concurrent calls score all their (query, passage) pairs together.

    Args:
        reranker: a CrossEncoderReranker (score_pairs, apply_scores).
        max_requests: most requests whose pairs go into one scoring call.
    """

    def __init__(self, reranker, max_requests: int = 16) -> None:
        self.reranker = reranker
        self.batcher: MicroBatcher[tuple[str, list[str]], list[float]] = MicroBatcher(
            self._score_requests, max_requests, name="rerank-batcher")

    def rerank(self, query: str, hits: Sequence[Hit], top_n: int | None = None) -> list[Hit]:
        # As CrossEncoderReranker does: a negative top_n would slice off the last hits unnoticed.
        if top_n is not None and top_n < 0:
            raise ConfigError(f"top_n must be >= 0 or None, got {top_n}")
        if not hits or top_n == 0:
            return []
        scores = self.batcher((query, [h.text for h in hits]))
        return self.reranker.apply_scores(hits, scores, top_n)

    def _score_requests(self, requests: list[tuple[str, list[str]]]) -> list[list[float]]:
        pairs = [(query, passage) for query, passages in requests for passage in passages]
        flat = self.reranker.score_pairs(pairs)
        out, start = [], 0
        for _, passages in requests:
            out.append(flat[start : start + len(passages)])
            start += len(passages)
        return out

    def close(self) -> None:
        self.batcher.close()
