"""Scheduler: continuous batching with chunked prefill and recompute preemption over a BlockManager."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from generation.engine.block_manager import BlockManager
from generation.engine.chunk_reuse import ChunkReusePlanner
from generation.engine.limits import check_engine_limits
from generation.engine.sequence import Sequence, SequenceStatus
from rag.errors import GenerationError


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    Args:
        max_num_seqs: most sequences holding KV blocks at once. Range >= 1.
        max_num_batched_tokens: most tokens fed to the model in one step (prefill chunks plus one
            per decode). Range >= max_num_seqs, so that every running decode fits in a step, and
            >= max_model_len without chunked prefill, so that every prompt fits in a step.
        max_model_len: most tokens (prompt + output) of one sequence. Range >= 2.
        block_size: tokens per KV block; must equal the KV cache's and the block manager's. Range 1..256.
        enable_chunked_prefill: split prompts longer than the step's remaining budget over steps.
        num_scheduler_steps: most model steps one scheduled batch runs when every entry samples:
            after the first, the batch keeps decoding on the device, each step fed the tokens of
            the one before, with KV blocks reserved ahead. The host then schedules and syncs
            once per batch instead of once per token. Range >= 1 (1 = one step per batch).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    block_size: int = 16
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        # The engine resolves EngineConfig's None (model context, device default) before building this.
        if self.max_model_len is None or self.num_scheduler_steps is None:
            raise ValueError("SchedulerConfig needs max_model_len and num_scheduler_steps as numbers, not None")
        check_engine_limits(self)


@dataclass(frozen=True, slots=True)
class ScheduledEntry:
    """One sequence's share of a step: tokens start_pos..start_pos+num_new_tokens-1 are fed."""

    seq: Sequence
    num_new_tokens: int
    start_pos: int
    # True when the entry feeds the sequence's last pending token: the model samples one token for it.
    # A chunk that stops inside the prompt samples nothing.
    samples: bool

    @property
    def is_decode(self) -> bool:
        """One token that completes the sequence (query length 1); everything else is prefill."""
        return self.num_new_tokens == 1 and self.samples


@dataclass(frozen=True)
class ScheduledBatch:
    """What the model runs in one step, in order: decodes first, then prefill chunks.

    With num_steps > 1 every entry samples, and the batch runs num_steps model steps: the first
    as scheduled, each later one a decode of every entry fed the token the step before sampled.
    Blocks are reserved for the tokens a sequence can still use; steps past its end (max_tokens,
    max_model_len, or a stop the caller finds) produce tokens the caller discards.
    """

    entries: list[ScheduledEntry]
    # Sequences preempted while building this step; they wait for recompute.
    preempted: list[Sequence] = field(default_factory=list)
    num_steps: int = 1
    # (source block, destination block, position delta) KV copies to run before the step:
    # chunk KV of newly admitted sequences (chunk_reuse.py). Destinations are private blocks.
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries if not e.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for e in self.entries if e.is_decode)

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    @property
    def sampling_entries(self) -> list[ScheduledEntry]:
        return [e for e in self.entries if e.samples]

    @property
    def is_empty(self) -> bool:
        return not self.entries


class Scheduler:
    """Decides each step which sequences run and how many tokens each feeds.

    Sequences are admitted first come, first served; the head of the queue that does not fit
    blocks those behind it, so a long prompt is not starved by short ones. When blocks run out,
    the most recently arrived running sequence is preempted: its blocks are released and it
    recomputes prompt + output later (often mostly from the prefix cache).

    A sequence with chunk KV copied in (`Sequence.filled_ranges`) feeds only the runs between
    the filled ranges, in position order; several runs of one sequence may share a step, each an
    entry whose context ends where the run ends, so the kernels apply the true causal mask.

    Args:
        config: step limits.
        block_manager: the KV block pool; its block_size must equal config.block_size.
        chunk_planner: plans chunk KV reuse for segmented sequences (`Sequence.segments`);
            None admits them as ordinary prompts (exact reuse only).

    Raises:
        ValueError: the block sizes differ.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, chunk_planner: ChunkReusePlanner | None = None
    ) -> None:
        if block_manager.block_size != config.block_size:
            raise ValueError(
                f"block manager block_size {block_manager.block_size} != scheduler block_size {config.block_size}"
            )
        self.config = config
        self.block_manager = block_manager
        self.chunk_planner = chunk_planner
        # Prompt tokens fed to the model (prefill entries), against those served by the prefix
        # cache or by chunk copies: the "computed" side of the reuse metrics.
        self.num_computed_prompt_tokens = 0
        self.waiting: deque[Sequence] = deque()
        # Sorted by arrival, so the last one is the first to preempt.
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0
        # Most sequences in one scheduled batch since start: shows that concurrent requests were
        # batched together rather than served one after another.
        self.max_num_running = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new request.

        Raises:
            ValueError: the prompt leaves no room for an output token within max_model_len, does
                not fit in the whole KV pool, or seq was already added or has run.
        """
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {seq.num_tokens} tokens but max_model_len is {self.config.max_model_len} "
                "(prompt + at least one output token): shorten the prompt"
            )
        pool_tokens = self.block_manager.num_blocks * self.config.block_size
        if seq.num_tokens > pool_tokens:
            raise ValueError(
                f"the prompt has {seq.num_tokens} tokens but the whole KV cache holds {pool_tokens}: "
                "shorten the prompt or give the engine more KV cache memory"
            )
        if seq.seq_id in self._seqs or seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"{seq} was already added to a scheduler")
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        """Drop a request wherever it is and release its blocks; False if it is unknown or done."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        return True

    def schedule(self) -> ScheduledBatch:
        """Build the next step: running decodes, running prefill chunks, then newly admitted prompts.

        Raises:
            GenerationError: a sequence needs more KV blocks than the whole pool has.
        """
        budget = self.config.max_num_batched_tokens
        entries: list[ScheduledEntry] = []
        scheduled: set[int] = set()
        preempted: list[Sequence] = []

        # Decodes first: they hold KV already and each costs one token, so they never starve.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_pending_tokens != 1:
                continue
            if not self._reserve_next_block(seq, scheduled, preempted):
                continue  # seq preempted itself
            entries.append(ScheduledEntry(seq, 1, seq.num_computed_tokens, samples=True))
            scheduled.add(seq.seq_id)
            budget -= 1

        # Prompts already admitted: their blocks were allocated in full at admission.
        for seq in self.running:
            if budget == 0:
                break
            if seq.seq_id in scheduled:
                continue
            added = self._prefill_entries(seq, budget)
            entries += added
            scheduled.add(seq.seq_id)
            budget -= sum(e.num_new_tokens for e in added)

        # Admitting after a preemption would take back the blocks just freed and thrash.
        kv_copies: list[tuple[int, int, int]] = []
        if not preempted:
            self._admit(entries, budget, kv_copies)
        num_steps = self._plan_steps(entries) if not preempted else 1
        self.max_num_running = max(self.max_num_running, len({e.seq.seq_id for e in entries}))
        return ScheduledBatch(entries, preempted, num_steps, kv_copies)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, list[int]]) -> list[Sequence]:
        """Account for a batch the model ran; returns the sequences that finished and were freed.

        Args:
            batch: the batch as `schedule` returned it.
            sampled: seq_id -> the tokens the caller keeps of what each sampling entry sampled,
                in order: one per step the batch ran, cut after the sequence's last token (a stop,
                max_tokens or max_model_len); at least one. The caller's stop logic marks
                `seq.finished` beforehand; max_tokens and max_model_len are checked here too.

        Raises:
            ValueError: a sampling entry has no token in `sampled`, or more than the batch's steps.
        """
        finished: list[Sequence] = []
        max_model_len = self.config.max_model_len
        for entry in batch.entries:
            seq = entry.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule and postprocess
            assert seq.num_computed_tokens == entry.start_pos, f"{seq} moved since it was scheduled"
            # Past a filled range that follows the run: its KV was copied in, not computed.
            seq.num_computed_tokens = seq.skip_filled(seq.num_computed_tokens + entry.num_new_tokens)
            if seq.held_blocks:
                self.block_manager.release_held(seq)  # the step's copies have run
            if not entry.is_decode:
                self.num_computed_prompt_tokens += entry.num_new_tokens
            if entry.samples:
                tokens = sampled.get(seq.seq_id)
                if not tokens or len(tokens) > batch.num_steps:
                    raise ValueError(
                        f"sequence {seq.seq_id} sampled in this batch of {batch.num_steps} step(s) but got "
                        f"{len(tokens) if tokens else 'no sampled token'}"
                    )
                seq.token_ids += tokens
                # Steps after the first fed each kept token but the last: their KV is computed.
                seq.num_computed_tokens += len(tokens) - 1
            self.block_manager.register_full_blocks(seq)
            # Only a sampling entry can finish seq: it is the sequence's last in the batch, and
            # earlier runs of the same sequence (chunk reuse) must still be accounted first.
            done = seq.finished or seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len
            if entry.samples and done:
                self._finish(seq)
                finished.append(seq)
        return finished

    def final_length(self, seq: Sequence) -> int:
        """Tokens seq holds when it finishes unless a stop comes first (max_tokens, max_model_len)."""
        return min(seq.num_prompt_tokens + seq.max_tokens, self.config.max_model_len)

    def _plan_steps(self, entries: list[ScheduledEntry]) -> int:
        """Steps to run the batch for, reserving the blocks that the steps after the first write.

        Only when every entry is a decode: a chunk that stops inside its prompt has nothing to
        decode, and a prompt that completes must hand its first token to its client now, not
        after the lookahead steps (that wait would be all of a served request's extra time to
        first token). Only as many steps as the longest-lived sequence can use. If the pool
        cannot hold every lookahead, the batch runs one step: no preemption for lookahead.
        """
        max_steps = self.config.num_scheduler_steps
        if max_steps == 1 or not entries or not all(e.is_decode for e in entries):
            return 1
        manager = self.block_manager
        # Step 1 samples token num_tokens; step j feeds token num_tokens + j - 2, whose KV needs a slot.
        capacities: list[int] = []
        num_steps = needed = 0
        for entry in entries:
            seq = entry.seq
            useful = min(max_steps, self.final_length(seq) - seq.num_tokens)
            num_steps = max(num_steps, useful)
            capacities.append(seq.num_tokens + useful - 1)
            needed += manager.blocks_needed(seq, capacities[-1])
        if num_steps <= 1 or needed > manager.num_free_blocks:
            return 1
        for entry, capacity in zip(entries, capacities, strict=True):
            grown = manager.ensure_capacity(entry.seq, capacity)
            assert grown
        return num_steps

    def _reserve_next_block(self, seq: Sequence, scheduled: set[int], preempted: list[Sequence]) -> bool:
        """Make room for seq's pending token, preempting newer sequences; False if seq itself went."""
        manager = self.block_manager
        if len(seq.block_table) * self.config.block_size >= seq.num_tokens:
            return True  # the usual decode: its token lands in a block it already holds
        while not manager.can_append(seq):
            self._check_fits_pool(seq)
            # The newest running sequence not already in this step (seq itself at the latest).
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        manager.may_append(seq)
        return True

    def _prefill_entries(self, seq: Sequence, budget: int) -> list[ScheduledEntry]:
        """seq's next runs that fit the budget, in position order (one for an ordinary prompt)."""
        entries: list[ScheduledEntry] = []
        start, total = seq.num_computed_tokens, seq.num_tokens
        while budget > 0 and start < total:
            run_end = seq.run_end(start)
            num_new = min(run_end - start, budget)
            entries.append(ScheduledEntry(seq, num_new, start, samples=start + num_new == total))
            budget -= num_new
            if start + num_new < run_end:
                break  # the budget ran out inside the run
            start = seq.skip_filled(run_end)
        return entries

    def _admit(self, entries: list[ScheduledEntry], budget: int, kv_copies: list[tuple[int, int, int]]) -> None:
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.waits_for & self._seqs.keys():
                break  # its chunks' canonical KV is still being computed (first come, first served)
            self._check_fits_pool(seq)
            if manager.host_tier is not None:
                # GPU misses that the host tier holds come back first, then match like any hit.
                manager.restore_from_host(seq)
                if self.chunk_planner is not None and seq.segments is not None:
                    self.chunk_planner.restore_from_host(seq)
            hits = manager.match(seq)  # hashing and looking up a long prompt once, not three times
            plan = None
            if self.chunk_planner is not None and seq.segments is not None:
                plan = self.chunk_planner.plan(seq, len(hits))
            if not manager.can_allocate(seq, hits, plan):
                break
            filled = plan.num_filled_tokens if plan is not None else 0
            pending = seq.num_tokens - len(hits) * self.config.block_size - filled
            if pending > budget and not self.config.enable_chunked_prefill:
                break  # waits for a step where the whole prompt fits
            manager.allocate(seq, hits, plan)
            if plan is not None:
                self.chunk_planner.record(plan)
                kv_copies += seq.kv_copies
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival_order)
            added = self._prefill_entries(seq, budget)
            entries += added
            budget -= sum(e.num_new_tokens for e in added)

    def _check_fits_pool(self, seq: Sequence) -> None:
        needed = seq.num_blocks(self.config.block_size)
        if needed > self.block_manager.num_blocks:
            raise GenerationError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens and needs {needed} KV blocks, but the "
                f"whole cache has {self.block_manager.num_blocks}: give the engine more KV cache memory or "
                "lower max_model_len / max_tokens"
            )

    def _preempt(self, seq: Sequence) -> None:
        # Recompute, not swap: the KV is dropped and prompt + output so far are fed again later.
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        # Front of the queue: it arrived before everything still waiting.
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finished = True
        del self._seqs[seq.seq_id]


def _arrival_order(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id
