"""The engine's batch and KV-block limits, checked in one place for EngineConfig and SchedulerConfig."""

from __future__ import annotations

from typing import Protocol

# The top of block_size's range, as EngineConfig has always documented it (1..256).
MAX_BLOCK_SIZE = 256


class EngineLimits(Protocol):
    """The limits EngineConfig and SchedulerConfig share (read-only: both are frozen dataclasses)."""

    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_scheduler_steps(self) -> int | None: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...


def check_engine_limits(limits: EngineLimits) -> None:
    """Refuse limits the engine cannot run with; the messages name the setting and its valid range.

    EngineConfig has None for max_model_len and num_scheduler_steps when the engine resolves
    them later (from the model and the device); SchedulerConfig has the resolved values, so a
    check that needs max_model_len runs as soon as it is known and again once it is resolved.

    Raises:
        ValueError: the first limit out of range.
    """
    max_num_seqs, max_num_batched_tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    max_model_len, block_size, num_scheduler_steps = limits.max_model_len, limits.block_size, limits.num_scheduler_steps
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
            f"({max_num_seqs}) so that every running request can decode in one step"
        )
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be None or >= 2, got {max_model_len}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE} (16 is usual), got {block_size}")
    if num_scheduler_steps is not None and num_scheduler_steps < 1:
        raise ValueError(f"num_scheduler_steps must be None or >= 1, got {num_scheduler_steps}")
    if max_model_len is not None and not limits.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"without chunked prefill max_num_batched_tokens must be >= max_model_len ({max_model_len}) "
            f"so that the longest prompt fits in one step, got {max_num_batched_tokens}; "
            "raise it or enable chunked prefill"
        )
