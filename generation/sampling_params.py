"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    Args:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it. Range [0, 100].
        top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches top_p.
            Range (0, 1]; 1 disables it.
        top_k: keep only the k most likely tokens; -1 disables it. Range -1 or >= 1.
        max_tokens: most tokens to generate (finish_reason "length" when reached). Range >= 1.
        stop: strings that end generation; the returned text stops before the first one found.
        stop_token_ids: token ids that end generation (like EOS, even with ignore_eos).
        ignore_eos: keep generating past EOS tokens (benchmarks, parity tests).
        seed: seeds this request's own random generator so that the same seed gives the same text.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience but stored as tuples-in-spirit: copy them so a caller
        # mutating its list later cannot change a frozen params object.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100] (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax instead of drawing (temperature 0)."""
        return self.temperature == 0.0
