"""Engine limits: EngineConfig and SchedulerConfig refuse the same bad values with the same message."""

from __future__ import annotations

from typing import Any

import pytest

from generation.config import EngineConfig
from generation.engine.scheduler import SchedulerConfig

# Each case: settings given to both configs, and the whole message a user reads (the words
# EngineConfig has always used; `rag engine serve` prints it after "invalid engine setting: ").
SHARED_LIMITS = [
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
    (
        {"max_num_seqs": 8, "max_num_batched_tokens": 4},
        "max_num_batched_tokens (4) must be >= max_num_seqs (8) so that every running request can decode in one step",
    ),
    ({"max_model_len": 1}, "max_model_len must be None or >= 2, got 1"),
    ({"block_size": 0}, "block_size must be in 1..256 (16 is usual), got 0"),
    ({"block_size": 257}, "block_size must be in 1..256 (16 is usual), got 257"),
    ({"num_scheduler_steps": 0}, "num_scheduler_steps must be None or >= 1, got 0"),
    (
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 4096},
        "without chunked prefill max_num_batched_tokens must be >= max_model_len (4096) so that the longest "
        "prompt fits in one step, got 512; raise it or enable chunked prefill",
    ),
]


@pytest.mark.parametrize("config_type", [EngineConfig, SchedulerConfig])
@pytest.mark.parametrize(("kwargs", "message"), SHARED_LIMITS)
def test_shared_limits_are_refused_with_one_message(config_type: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        config_type(**kwargs)
    assert str(raised.value) == message


@pytest.mark.parametrize("config_type", [EngineConfig, SchedulerConfig])
def test_the_edges_of_every_range_are_accepted(config_type: type) -> None:
    config = config_type(
        max_num_seqs=1, max_num_batched_tokens=2, max_model_len=2, block_size=256, num_scheduler_steps=1,
        enable_chunked_prefill=False,
    )  # fmt: skip
    assert (config.max_num_seqs, config.max_model_len, config.block_size) == (1, 2, 256)


def test_engine_config_leaves_unresolved_limits_to_the_engine() -> None:
    # None: the model's context and the device's default step count, resolved when the engine starts;
    # the chunked-prefill check then runs in SchedulerConfig with the resolved length.
    config = EngineConfig(max_model_len=None, num_scheduler_steps=None, enable_chunked_prefill=False)
    assert config.scheduler_steps_on("cpu") == 1 and config.scheduler_steps_on("cuda") == 8


@pytest.mark.parametrize("unresolved", ["max_model_len", "num_scheduler_steps"])
def test_scheduler_config_needs_resolved_limits(unresolved: str) -> None:
    with pytest.raises(ValueError, match=f"{unresolved} and|and {unresolved}"):
        SchedulerConfig(**{unresolved: None})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0, 1], got 0.0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be None (measure) or >= 1, got 0"),
        ({"dtype": "int8"}, "dtype 'int8' is not supported; valid: None, float32, float16, bfloat16"),
    ],
)
def test_engine_only_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        EngineConfig(**kwargs)
    assert str(raised.value) == message
