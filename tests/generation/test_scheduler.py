"""Scheduler: continuous batching, token budget, chunked prefill, preemption, abort, torch-free core."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from generation.engine.block_manager import BlockManager
from generation.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from generation.engine.sequence import Sequence, SequenceStatus
from rag.errors import GenerationError

ROOT = Path(__file__).resolve().parents[2]
BS = 4
VOCAB = 16
STOP = 0  # the fake caller's stop token


def next_token(seq: Sequence, upto: int, tokens: list[int] | None = None) -> int:
    """The fake model's pick after the first `upto` tokens (of seq, or of `tokens`): depends on the whole context.

    blake2b, not hash(): str hashes change between processes, and the tests must not.
    """
    context = repr((seq.namespace, (seq.token_ids if tokens is None else tokens)[:upto])).encode()
    return hashlib.blake2b(context, digest_size=4).digest()[0] % VOCAB


def reference_output(
    prompt: list[int], namespace: str | None, max_tokens: int, max_model_len: int, stop: bool = False
) -> list[int]:
    """What any schedule must produce for this request: the fake model's tokens until it finishes."""
    seq = Sequence(prompt, max_tokens=max_tokens, namespace=namespace)
    while True:
        token = next_token(seq, seq.num_tokens)
        seq.append_token(token)
        if (stop and token == STOP) or seq.num_output_tokens >= max_tokens or seq.num_tokens >= max_model_len:
            return seq.output_token_ids


class FakeRunner:
    """Stands in for the model runner: checks the KV it attends to and writes the KV it computes.

    Each slot gets a fingerprint of (namespace, context up to that token), so a wrong block
    table, a bad prefix-cache hit or a write into a shared block shows up as a mismatch. A batch
    of several steps decodes on after the first, each step fed the token the step before sampled,
    as the model runner does; steps past a sequence's useful end write only into blocks it holds.
    """

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: dict[int, int] = {}

    def run(self, batch: ScheduledBatch, final_length: Callable[[Sequence], int]) -> dict[int, list[int]]:
        """seq_id -> one token per step of the batch for each sampling entry."""
        sampled = {}
        for entry in batch.entries:
            seq, start, end = entry.seq, entry.start_pos, entry.start_pos + entry.num_new_tokens
            assert start == seq.num_computed_tokens and end <= seq.num_tokens
            assert len(seq.block_table) * BS >= end, "scheduled tokens without blocks"
            self._attend(seq, seq.token_ids, start)
            for pos in range(start, end):
                self._write(seq, seq.token_ids, pos)
            assert entry.samples == (end == seq.num_tokens)
            if not entry.samples:
                continue
            tokens = list(seq.token_ids)
            tokens.append(next_token(seq, end, tokens))
            useful = min(batch.num_steps, final_length(seq) - seq.num_tokens)
            for step in range(2, batch.num_steps + 1):
                pos = len(tokens) - 1  # the token the step before sampled
                reserved = pos < len(seq.block_table) * BS
                assert reserved or step > useful, f"{seq}: no block reserved for lookahead step {step}"
                if reserved:
                    if step <= useful:
                        self._attend(seq, tokens, pos)
                    self._write(seq, tokens, pos)
                tokens.append(next_token(seq, len(tokens), tokens))
            sampled[seq.seq_id] = tokens[seq.num_tokens :]
        return sampled

    def _attend(self, seq: Sequence, tokens: list[int], upto: int) -> None:
        for pos in range(upto):
            slot = seq.block_table[pos // BS] * BS + pos % BS
            assert self.kv[slot] == self._print(seq, tokens, pos), f"{seq} attends to foreign KV at {pos}"

    def _write(self, seq: Sequence, tokens: list[int], pos: int) -> None:
        block = seq.block_table[pos // BS]
        assert self.bm.ref_count(block) == 1, "wrote into a shared block"
        self.kv[block * BS + pos % BS] = self._print(seq, tokens, pos)

    @staticmethod
    def _print(seq: Sequence, tokens: list[int], pos: int) -> int:
        return hash((seq.namespace, tuple(tokens[: pos + 1])))


def make(num_blocks: int = 64, prefix_cache: bool = True, **config: int | bool) -> tuple[Scheduler, FakeRunner]:
    defaults = {"block_size": BS, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 64}
    cfg = SchedulerConfig(**{**defaults, **config})
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_cache)
    return Scheduler(cfg, bm), FakeRunner(bm)


def keep(sched: Scheduler, batch: ScheduledBatch, sampled: dict[int, list[int]], stop: bool) -> dict[int, list[int]]:
    """The engine's stop logic: cut each sequence's tokens after STOP (with `stop`) or its final length."""
    kept = {}
    for entry in batch.sampling_entries:
        seq = entry.seq
        tokens = sampled[seq.seq_id][: sched.final_length(seq) - seq.num_tokens]
        if stop and STOP in tokens:
            tokens = tokens[: tokens.index(STOP) + 1]
            seq.finished = True
        kept[seq.seq_id] = tokens
    return kept


def step(sched: Scheduler, runner: FakeRunner, stop: bool = False) -> tuple[ScheduledBatch, list[Sequence]]:
    """One engine step; with `stop`, the caller finishes a sequence that samples STOP."""
    batch = sched.schedule()
    assert batch.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert sched.num_running <= sched.config.max_num_seqs
    assert batch.num_steps == 1 or all(e.samples for e in batch.entries)
    sampled = keep(sched, batch, runner.run(batch, sched.final_length), stop)
    finished = sched.postprocess(batch, sampled)
    sched.block_manager.check_invariants()
    return batch, finished


def run_to_completion(sched: Scheduler, runner: FakeRunner, stop: bool = False) -> int:
    steps = 0
    while sched.has_unfinished():
        step(sched, runner, stop)
        steps += 1
        assert steps < 10_000, "the scheduler stopped making progress"
    return steps


def shape(batch: ScheduledBatch) -> list[tuple[int, int, int, bool]]:
    return [(e.seq.seq_id, e.num_new_tokens, e.start_pos, e.samples) for e in batch.entries]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "max_num_batched_tokens"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"block_size": 0}, "block_size"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}, "chunked prefill"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, int | bool], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_block_sizes_must_agree() -> None:
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=16), BlockManager(8, 8))


def test_add_rejects_impossible_and_repeated_requests() -> None:
    sched, _ = make(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(Sequence(range(32), max_tokens=4))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(Sequence(range(17), max_tokens=4))
    seq = Sequence(range(16), max_tokens=4)
    sched.add(seq)
    with pytest.raises(ValueError, match="already"):
        sched.add(seq)


def test_new_requests_join_while_others_decode() -> None:
    sched, runner = make()
    a = Sequence(range(1, 7), max_tokens=50, arrival_time=0)
    sched.add(a)
    assert shape(step(sched, runner)[0]) == [(a.seq_id, 6, 0, True)]
    step(sched, runner)
    b = Sequence(range(20, 30), max_tokens=50, arrival_time=1)
    sched.add(b)
    batch, _ = step(sched, runner)
    assert shape(batch) == [(a.seq_id, 1, 7, True), (b.seq_id, 10, 0, True)]
    assert (batch.num_decode_tokens, batch.num_prefill_tokens) == (1, 10)
    batch, _ = step(sched, runner)
    assert shape(batch) == [(a.seq_id, 1, 8, True), (b.seq_id, 1, 10, True)]


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    sched, runner = make(max_num_batched_tokens=8, max_num_seqs=4)
    a = Sequence([1, 2], max_tokens=50, arrival_time=0)
    sched.add(a)
    step(sched, runner)
    b = Sequence(range(1, 21), max_tokens=50, arrival_time=1)
    sched.add(b)
    shapes = [shape(step(sched, runner)[0]) for _ in range(4)]
    assert shapes == [
        [(a.seq_id, 1, 2, True), (b.seq_id, 7, 0, False)],
        [(a.seq_id, 1, 3, True), (b.seq_id, 7, 7, False)],
        [(a.seq_id, 1, 4, True), (b.seq_id, 6, 14, True)],
        [(a.seq_id, 1, 5, True), (b.seq_id, 1, 20, True)],
    ]
    assert b.output_token_ids == reference_output(list(range(1, 21)), None, 50, 64)[:2]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits() -> None:
    sched, runner = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    a = Sequence([1, 2], max_tokens=3, arrival_time=0)
    b = Sequence(range(1, 16), max_tokens=3, arrival_time=1)
    sched.add(a)
    step(sched, runner)
    sched.add(b)
    batch, _ = step(sched, runner)  # 1 decode token + 15 prompt tokens = 16: fits
    assert shape(batch) == [(a.seq_id, 1, 2, True), (b.seq_id, 15, 0, True)]

    sched, runner = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    a, c = Sequence([1, 2], max_tokens=3, arrival_time=0), Sequence([3, 4], max_tokens=3, arrival_time=0)
    b = Sequence(range(1, 16), max_tokens=3, arrival_time=1)
    sched.add(a)
    sched.add(c)
    step(sched, runner)
    sched.add(b)
    batch, _ = step(sched, runner)  # 2 decodes leave 14 tokens: b waits whole, not in chunks
    assert [e.seq for e in batch.entries] == [a, c] and b.status is SequenceStatus.WAITING
    run_to_completion(sched, runner)
    assert b.output_token_ids == reference_output(list(range(1, 16)), None, 3, 16)


def test_max_num_seqs_caps_the_running_set() -> None:
    sched, runner = make(max_num_seqs=2)
    seqs = [Sequence([i + 1, i + 2], max_tokens=3, arrival_time=i) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    batch, _ = step(sched, runner)
    assert [e.seq for e in batch.entries] == seqs[:2] and sched.num_waiting == 3
    peak = 0
    while sched.has_unfinished():
        step(sched, runner)
        peak = max(peak, sched.num_running)
    assert peak == 2
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)


def test_prefix_hits_skip_prompt_tokens() -> None:
    sched, runner = make()
    doc = list(range(1, 13))
    first = Sequence([*doc, 13], max_tokens=1, arrival_time=0)
    sched.add(first)
    run_to_completion(sched, runner)
    second = Sequence([*doc, 14, 15], max_tokens=2, arrival_time=1)
    sched.add(second)
    batch, _ = step(sched, runner)
    assert shape(batch) == [(second.seq_id, 2, 12, True)]
    assert second.num_cached_tokens == 12
    run_to_completion(sched, runner)
    assert second.output_token_ids == reference_output([*doc, 14, 15], None, 2, 64)


def test_preemption_frees_the_newest_and_recomputes_it_later() -> None:
    # 6 blocks of 4 tokens; three requests of 2 blocks fill the pool, then the oldest grows.
    sched, runner = make(num_blocks=6, prefix_cache=False)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [2, 4, 6, 8, 10, 12, 14]]
    seqs = [Sequence(p, max_tokens=6, arrival_time=i) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    step(sched, runner)  # all three prefilled: 6 blocks in use, 8th token of each sampled
    step(sched, runner)  # the 8th tokens still fit in the second blocks
    assert sched.block_manager.num_free_blocks == 0
    batch, _ = step(sched, runner)  # each now needs a third block for its 9th token: the newest go
    newest = seqs[2]
    assert batch.preempted == [newest]  # its 2 blocks are enough for the two older ones
    assert [e.seq for e in batch.entries] == seqs[:2]
    assert newest.status is SequenceStatus.WAITING and newest.block_table == [] and newest.num_computed_tokens == 0
    assert newest.num_output_tokens == 2  # kept: recompute feeds prompt + output
    assert list(sched.waiting) == [newest]
    late = Sequence([3, 3], max_tokens=2, arrival_time=10)
    sched.add(late)
    assert list(sched.waiting)[-1] is late  # preempted requests go before newer arrivals
    run_to_completion(sched, runner)
    assert sched.num_preemptions >= 1
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == reference_output(prompt, None, 6, 64)
    assert sched.block_manager.num_free_blocks == 6


def test_a_sequence_too_big_for_the_whole_pool_is_a_clear_error() -> None:
    sched, runner = make(num_blocks=2)
    sched.add(Sequence(range(1, 7), max_tokens=10))
    with pytest.raises(GenerationError, match="KV blocks"):
        run_to_completion(sched, runner)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    sched, runner = make(num_blocks=8, max_num_seqs=1)
    running = Sequence(range(1, 10), max_tokens=20, arrival_time=0)
    waiting = Sequence(range(1, 5), max_tokens=20, arrival_time=1)
    sched.add(running)
    sched.add(waiting)
    step(sched, runner)
    assert sched.block_manager.num_used_blocks == 3
    assert sched.abort(waiting.seq_id) and sched.num_waiting == 0
    batch = sched.schedule()
    sampled = runner.run(batch, sched.final_length)
    assert sched.abort(running.seq_id)  # arrives while the model runs the step
    assert sched.postprocess(batch, sampled) == []
    assert not sched.has_unfinished() and running.status is SequenceStatus.FINISHED
    assert sched.block_manager.num_used_blocks == 0
    assert not sched.abort(running.seq_id) and not sched.abort(12345)
    sched.block_manager.check_invariants()


def test_postprocess_needs_a_token_for_every_sampling_entry() -> None:
    sched, _ = make()
    sched.add(Sequence([1, 2], max_tokens=5))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.postprocess(batch, {})


def test_postprocess_finishes_on_stop_flag_max_tokens_and_max_model_len() -> None:
    sched, _ = make(max_model_len=10)
    by_flag = Sequence([1, 2], max_tokens=50, arrival_time=0)
    by_tokens = Sequence([3, 4], max_tokens=2, arrival_time=1)
    by_length = Sequence(range(1, 8), max_tokens=50, arrival_time=2)
    for seq in (by_flag, by_tokens, by_length):
        sched.add(seq)
    batch = sched.schedule()
    by_flag.finished = True  # the engine's stop logic saw a stop string
    assert sched.postprocess(batch, {e.seq.seq_id: [5] for e in batch.entries}) == [by_flag]
    finished_at: dict[int, int] = {}
    while sched.has_unfinished():
        batch = sched.schedule()
        for seq in sched.postprocess(batch, {e.seq.seq_id: [5] for e in batch.entries}):
            finished_at[seq.seq_id] = seq.num_tokens
    assert finished_at == {by_tokens.seq_id: 4, by_length.seq_id: 10}
    assert by_flag.num_output_tokens == 1 and by_flag.status is SequenceStatus.FINISHED
    assert sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("chunked", "prefix_cache", "seed", "steps"),
    [(True, True, 0, 1), (True, False, 1, 1), (False, True, 2, 1), (True, True, 3, 1), (True, True, 4, 4),
     (False, False, 5, 3), (True, True, 6, 8)],
)  # fmt: skip
def test_random_workload_completes_with_reference_outputs_and_frees_everything(
    chunked: bool, prefix_cache: bool, seed: int, steps: int
) -> None:
    rng = random.Random(seed)
    max_model_len = 48
    sched, runner = make(
        num_blocks=20,
        prefix_cache=prefix_cache,
        max_num_seqs=6,
        max_num_batched_tokens=48 if not chunked else 20,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        num_scheduler_steps=steps,
    )
    docs = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    expected: dict[int, list[int]] = {}
    requests: list[Sequence] = []
    aborted: set[int] = set()
    num_chunks = 0  # prefill entries that stop inside a prompt
    num_multi_step = 0  # batches that ran more than one step
    for i in range(60):
        # Requests keep arriving while others run, as RAG queries over shared documents do.
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = [*rng.choice(docs), *(rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 8)))]
            namespace = rng.choice([None, "lab-a", "lab-b"])
            max_tokens = rng.randrange(1, 24)
            seq = Sequence(prompt, max_tokens=max_tokens, namespace=namespace, arrival_time=i)
            sched.add(seq)
            requests.append(seq)
            expected[seq.seq_id] = reference_output(prompt, namespace, max_tokens, max_model_len, stop=True)
        if requests and rng.random() < 0.03:
            victim = rng.choice(requests)
            if sched.abort(victim.seq_id):
                aborted.add(victim.seq_id)
        if sched.has_unfinished():
            batch, _ = step(sched, runner, stop=True)
            num_chunks += sum(1 for e in batch.entries if not e.samples)
            num_multi_step += batch.num_steps > 1
    run_to_completion(sched, runner, stop=True)
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    for seq in requests:
        assert seq.status is SequenceStatus.FINISHED
        if seq.seq_id not in aborted:
            assert seq.output_token_ids == expected[seq.seq_id], f"{seq} generated other tokens"
    assert sched.num_preemptions > 0  # the pool is small enough that the run exercised preemption
    if prefix_cache:
        assert bm.num_hit_tokens > 0
    assert (num_chunks > 0) == chunked
    assert (num_multi_step > 0) == (steps > 1)


def test_a_batch_of_decodes_runs_several_steps_with_blocks_reserved() -> None:
    sched, runner = make(num_scheduler_steps=4, max_model_len=64)
    a = Sequence(range(1, 7), max_tokens=50, arrival_time=0)  # 6 tokens: the prompt fits one step
    sched.add(a)
    batch, _ = step(sched, runner)
    # A completing prompt runs one step: its first token goes out at once.
    assert batch.num_steps == 1 and a.num_tokens == 7 and a.num_computed_tokens == 6
    batch, _ = step(sched, runner)
    # Decodes only: four steps, KV up to position 9 computed, 11 tokens held.
    assert batch.num_steps == 4 and a.num_tokens == 11 and a.num_computed_tokens == 10
    assert len(a.block_table) == 3  # blocks for 10 tokens, no more
    assert a.output_token_ids == reference_output(list(range(1, 7)), None, 50, 64)[:5]
    b = Sequence(range(20, 31), max_tokens=2, arrival_time=1)
    sched.add(b)
    batch, _ = step(sched, runner)
    assert shape(batch) == [(a.seq_id, 1, 10, True), (b.seq_id, 11, 0, True)] and batch.num_steps == 1
    batch, _ = step(sched, runner)
    assert batch.num_steps == 4  # as many as a can use; b's steps past its end are discarded
    assert b.status is SequenceStatus.FINISHED and b.num_output_tokens == 2
    assert a.num_output_tokens == 10


def test_lookahead_is_capped_by_what_any_sequence_can_use() -> None:
    sched, runner = make(num_scheduler_steps=8)
    short = Sequence([1, 2, 3], max_tokens=3)
    sched.add(short)
    assert step(sched, runner)[0].num_steps == 1  # the prompt
    batch, _ = step(sched, runner)
    assert batch.num_steps == 2 and short.status is SequenceStatus.FINISHED
    assert sched.block_manager.num_used_blocks == 0


def test_a_prompt_chunk_or_a_short_pool_runs_one_step() -> None:
    sched, runner = make(num_scheduler_steps=4, max_num_batched_tokens=8, max_num_seqs=4)
    a = Sequence([1, 2], max_tokens=50, arrival_time=0)
    sched.add(a)
    step(sched, runner)
    sched.add(Sequence(range(1, 21), max_tokens=50, arrival_time=1))
    batch, _ = step(sched, runner)  # a decodes, b's first chunk stops inside its prompt
    assert batch.num_steps == 1
    # 2 blocks of 4: after its prompt step c holds 3 tokens; 4 steps need slots up to token 6.
    sched, runner = make(num_blocks=2, num_scheduler_steps=4)
    c = Sequence([1, 2], max_tokens=50)
    sched.add(c)
    assert step(sched, runner)[0].num_steps == 1
    assert step(sched, runner)[0].num_steps == 4
    assert step(sched, runner)[0].num_steps == 1  # the pool has no block for the lookahead


_TORCH_BLOCKED_IMPORT = """
import importlib, importlib.abc, sys, types

class BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, BlockTorch())
# The package __init__ files load the torch generator; stand-ins test the module by itself.
for name, folder in (("generation", "generation"), ("generation.engine", "generation/engine")):
    package = types.ModuleType(name)
    package.__path__ = [sys.argv[1] + "/" + folder]
    sys.modules[name] = package
importlib.import_module(sys.argv[2])
assert "torch" not in sys.modules
"""


def _import_without_torch(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _TORCH_BLOCKED_IMPORT, str(ROOT), module],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("module", ["sequence", "limits", "prefix_cache", "block_manager", "scheduler"])
def test_engine_core_imports_without_torch(module: str) -> None:
    result = _import_without_torch(f"generation.engine.{module}")
    assert result.returncode == 0, result.stderr


def test_the_torch_blocker_does_block() -> None:
    result = _import_without_torch("generation.engine.output_state")  # imports torch
    assert result.returncode != 0 and "blocked" in result.stderr
