"""AsyncLLMEngine: concurrent streams, requests joining mid-flight, consumers leaving, errors."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from generation import SamplingParams
from generation.config import EngineConfig
from generation.engine.async_engine import AsyncLLMEngine
from generation.engine.llm_engine import LLMEngine
from rag.errors import GenerationError

PROMPTS = [[60, 61, 62, 63, 64, 65], [10, 20, 30], [70] * 21]


@pytest.fixture(scope="module")
def async_engine(tiny_model_factory):
    path, _ = tiny_model_factory("default", tokenizer=True)
    engine = AsyncLLMEngine(LLMEngine(path, EngineConfig(device="cpu", block_size=4)))
    yield engine
    engine.shutdown()


def wait_until(condition, timeout: float = 10.0) -> None:
    """Poll: the step thread applies aborts between steps, shortly after the consumer left."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def collect(engine: AsyncLLMEngine, prompt, params: SamplingParams, namespace: str | None = None) -> list[str]:
    return [delta async for delta in engine.generate(prompt, params, namespace)]


def test_concurrent_streams_equal_offline_generate(async_engine, tiny_llm):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 12, 20)]
    expected = [o.text for o in tiny_llm.generate(PROMPTS, params)]

    async def main() -> list[list[str]]:
        return await asyncio.gather(*(collect(async_engine, p, sp) for p, sp in zip(PROMPTS, params, strict=True)))

    streams = asyncio.run(main())
    assert ["".join(s) for s in streams] == expected
    assert all(len(s) > 5 for s in streams)  # deltas arrived one by one, not as one block


def test_a_request_joins_while_another_is_running(async_engine, tiny_llm):
    long_params = SamplingParams(max_tokens=150, ignore_eos=True)
    short_params = SamplingParams(max_tokens=5, ignore_eos=True)
    events: list[str] = []

    async def long_run() -> str:
        text = ""
        async for delta in async_engine.generate(PROMPTS[0], long_params):
            if not text:
                events.append("long started")
            text += delta
        events.append("long done")
        return text

    async def short_run() -> str:
        while "long started" not in events:
            await asyncio.sleep(0.001)
        text = "".join(await collect(async_engine, PROMPTS[1], short_params))
        events.append("short done")
        return text

    async def main() -> list[str]:
        return await asyncio.gather(long_run(), short_run())

    long_text, short_text = asyncio.run(main())
    # The short request was admitted mid-flight and finished while the long one kept decoding.
    assert events == ["long started", "short done", "long done"]
    expected = tiny_llm.generate([PROMPTS[0], PROMPTS[1]], [long_params, short_params])
    assert [long_text, short_text] == [o.text for o in expected]


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_consumer_that_leaves_aborts_its_request_and_frees_its_blocks(async_engine, how):
    engine = async_engine.engine
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main() -> None:
        if how == "aclose":
            stream = async_engine.generate(PROMPTS[2], params)
            await stream.__anext__()
            assert engine.num_unfinished_requests == 1
            await stream.aclose()
        else:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in async_engine.generate(PROMPTS[2], params):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(main())
    wait_until(lambda: not engine.has_unfinished_requests())
    metrics = async_engine.get_metrics()
    assert metrics.num_running == 0 and metrics.num_waiting == 0
    assert metrics.num_kv_blocks_used == 0
    engine.block_manager.check_invariants()


def test_updates_carry_tokens_output_and_latencies(async_engine):
    params = SamplingParams(max_tokens=7, ignore_eos=True)

    async def main():
        return [u async for u in async_engine.generate_updates(PROMPTS[1], params)]

    updates = asyncio.run(main())
    assert len(updates) == 7 and all(len(u.new_token_ids) == 1 for u in updates)
    assert [u.finished for u in updates] == [False] * 6 + [True]
    last = updates[-1]
    assert last.output is not None and last.finish_reason == "length"
    assert last.output.token_ids == [u.new_token_ids[0] for u in updates]
    assert last.output.text == "".join(u.text_delta for u in updates)
    assert last.metrics is not None and last.metrics.time_to_first_token > 0
    assert last.metrics.num_output_tokens == 7


def test_a_bad_request_raises_to_its_own_consumer(async_engine):
    async def main() -> None:
        with pytest.raises(GenerationError, match="empty"):
            await collect(async_engine, [], SamplingParams())
        # The engine still serves others.
        assert await collect(async_engine, PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))

    asyncio.run(main())
    assert async_engine.is_running


def test_after_shutdown_requests_fail(tiny_model_factory):
    path, _ = tiny_model_factory("default", tokenizer=True)
    engine = AsyncLLMEngine(LLMEngine(path, EngineConfig(device="cpu", max_num_seqs=4, num_kv_blocks=64)))
    engine.shutdown()
    assert not engine.is_running

    async def main() -> None:
        with pytest.raises(GenerationError, match="not running"):
            await collect(engine, PROMPTS[1], SamplingParams(max_tokens=3))

    asyncio.run(main())


class _IdleEngine:
    """Just enough of an LLMEngine for the step thread to wait: never any work."""

    def __init__(self, device: str) -> None:
        import types

        import torch

        self.model_runner = types.SimpleNamespace(device=torch.device(device))

    def has_unfinished_requests(self) -> bool:
        return False


@pytest.mark.parametrize(("device", "lowered"), [("cuda", True), ("cpu", False)])
def test_switch_interval_lowered_only_while_a_gpu_engine_runs(device, lowered):
    import sys

    before = sys.getswitchinterval()
    engine = AsyncLLMEngine(_IdleEngine(device), switch_interval_ms=0.2)  # type: ignore[arg-type]
    try:
        assert sys.getswitchinterval() == (pytest.approx(0.0002) if lowered else before)
    finally:
        engine.shutdown()
        engine.shutdown()  # a second shutdown must not release the interval twice
    assert sys.getswitchinterval() == before
    idle = AsyncLLMEngine(_IdleEngine(device))  # 0: left as it is
    assert sys.getswitchinterval() == before
    idle.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_gpu_engine_lowers_the_switch_interval_while_it_serves(tiny_model_factory):
    import sys

    path, _ = tiny_model_factory("default", tokenizer=True)
    before = sys.getswitchinterval()
    engine = AsyncLLMEngine(LLMEngine(path, EngineConfig(device="cuda", block_size=4)), switch_interval_ms=0.1)
    try:
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        text = "".join(asyncio.run(collect(engine, PROMPTS[0], params)))
        assert len(text) > 0
    finally:
        engine.shutdown()
    assert sys.getswitchinterval() == before
