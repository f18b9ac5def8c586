"""Micro-batching: concurrent callers share batches, results go back to the right caller, errors too."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rag.batching import BatchedQueryEmbedder, BatchedReranker, MicroBatcher
from rag.types import Hit


def _concurrently(n: int, fn) -> list:
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_calls_share_batches_and_get_their_own_results():
    sizes: list[int] = []

    def square(items: list[int]) -> list[int]:
        sizes.append(len(items))
        time.sleep(0.05)  # a forward pass: calls arriving meanwhile form the next batch
        return [x * x for x in items]

    batcher = MicroBatcher(square, max_batch=64)
    try:
        assert _concurrently(16, batcher) == [i * i for i in range(16)]
        assert batcher.stats.num_calls == 16 and batcher.stats.num_batches < 16 and max(sizes) > 1
        assert batcher(5) == 25  # alone: runs at once, a batch of one
        assert sizes[-1] == 1
    finally:
        batcher.close()


def test_one_callers_items_share_one_batch():
    # The feedback leg embeds its 5 passages together: one forward pass, not five.
    sizes: list[int] = []

    def square(items: list[int]) -> list[int]:
        sizes.append(len(items))
        return [x * x for x in items]

    batcher = MicroBatcher(square, max_batch=64)
    try:
        assert batcher.many([1, 2, 3, 4, 5]) == [1, 4, 9, 16, 25]
        assert sizes == [5] and batcher.stats.num_calls == 5
    finally:
        batcher.close()


def test_max_batch_is_respected():
    sizes: list[int] = []

    def ident(items):
        sizes.append(len(items))
        time.sleep(0.02)
        return items

    batcher = MicroBatcher(ident, max_batch=3)
    try:
        assert _concurrently(10, batcher) == list(range(10))
        assert max(sizes) <= 3
    finally:
        batcher.close()


def test_an_error_reaches_every_caller_of_its_batch_and_the_batcher_goes_on():
    def fail_on_seven(items):
        if 7 in items:
            raise ValueError("bad item")
        return items

    batcher = MicroBatcher(fail_on_seven, max_batch=1)
    try:
        with pytest.raises(ValueError, match="bad item"):
            batcher(7)
        assert batcher(3) == 3
    finally:
        batcher.close()


@pytest.fixture(scope="module")
def cpu_embedder():
    from ingest.embed.embedder import Embedder, EmbedderConfig

    e = Embedder(EmbedderConfig(device="cpu"))
    yield e
    e.close()


def test_batched_embedder_matches_one_at_a_time(cpu_embedder):
    questions = ["Which GPU nodes can I use?", "freezer alarm threshold", "how to book the microscope", "sbatch"]
    expected = [cpu_embedder.embed_query(q) for q in questions]
    embed = BatchedQueryEmbedder(cpu_embedder.embed)
    try:
        got = _concurrently(len(questions), lambda i: embed(questions[i]))
    finally:
        embed.close()
    for e, g in zip(expected, got, strict=True):
        assert np.allclose(e, g, atol=1e-5)


def test_one_pass_per_text_makes_a_question_independent_of_what_is_batched_beside_it(cpu_embedder):
    # The service's CPU setting: a question queued in one batch with another user's much longer
    # text gets the vector it gets alone, bit for bit (no padding, no other matmul shape).
    question = "Which GPU nodes can I use?"
    other = "an unrelated question about the weather in the mountains, asked at length " * 6
    alone = cpu_embedder.embed([question])[0]
    embed = BatchedQueryEmbedder(cpu_embedder.embed, one_per_pass=True)
    try:
        together = embed.many([question, other, question[:8]])  # one batch: `many` queues them together
        assert embed.batcher.stats.max_batch == 3
    finally:
        embed.close()
    assert np.array_equal(together[0], alone)
    assert np.array_equal(together[2], cpu_embedder.embed([question[:8]])[0])


def test_the_service_embeds_one_question_per_pass_on_a_cpu(rag_factory, tmp_path):
    rag = rag_factory(tmp_path / "home", device="cpu")
    assert str(rag.embedder.device) == "cpu" and rag.query_embedder.one_per_pass


def test_batched_reranker_matches_the_reranker_alone(model_cache):
    from retrieval.rerank import CrossEncoderReranker, resolve_reranker_dir

    reranker = CrossEncoderReranker(resolve_reranker_dir(None, model_cache), device="cpu")
    passages = ["gpu07 and gpu08 are reserved for imaging", "the freezer alarm is at -70 C",
                "book the microscope a week ahead", "use sbatch --gres=gpu:1"]
    hits = [Hit(i, f"d{i}", f"/d{i}", 0, p, 0.0) for i, p in enumerate(passages)]
    queries = ["Which GPU nodes are reserved?", "When does the freezer alarm go off?", "How do I ask for a GPU?"]
    expected = [reranker.rerank(q, hits, top_n=3) for q in queries]
    batched = BatchedReranker(reranker)
    try:
        got = _concurrently(len(queries), lambda i: batched.rerank(queries[i], hits, top_n=3))
    finally:
        batched.close()
    for e, g in zip(expected, got, strict=True):
        assert [h.chunk_id for h in e] == [h.chunk_id for h in g]
        assert np.allclose([h.score for h in e], [h.score for h in g], atol=1e-4)
