"""CacheBlend's token selection: which reused-chunk tokens are recomputed, chosen per request by KV deviation.

CacheBlend (arXiv 2405.16444; LMCache `lmcache/v1/compute/blend/blender.py`) recomputes the
tokens whose reused KV is furthest from what full prefill would give: at a check layer it
computes every token's fresh key, takes each reused token's squared L2 distance between the
fresh key and the cached one (summed over KV heads and channels), and from the check layer on
only the top `ratio` of the reused tokens are recomputed; the others keep their cached KV.
Layers before the check layer are computed in full for every token, so their KV is exact.

The distance is taken on pre-RoPE keys: both keys sit at the same position and RoPE rotates
each channel pair by the same angle, which preserves L2 norms, so pre- and post-RoPE distances
are equal and the reused key need not be rotated first.

Plain torch, no model: the slow reference (`generation/reference/chunk_blend.py`) calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEVIATION_OF = ("k", "v", "kv")


@dataclass(frozen=True)
class DeviationSelection:
    """The selection rule: the top `ratio` of a request's reused tokens by KV deviation at `check_layer`.

    Args:
        ratio: share of the reused tokens recomputed from the check layer on, in (0, 1].
        check_layer: the layer at which the deviation is measured (LMCache's default is 1: layer 0
            is computed for every token, and its output feeds the check). At least 1, so that the
            fresh keys of the check layer already carry cross-chunk attention.
        deviation_of: "k" (LMCache), "v" (the CacheBlend prototype) or "kv" (their sum).
        keep_first_block: also recompute every reused chunk's first KV block (its attention sink,
            as first-block recompute does), and select the ratio among the other reused tokens.

    Raises:
        ValueError: a ratio out of range, a check layer below 1 or an unknown deviation.
    """

    ratio: float = 0.15
    check_layer: int = 1
    deviation_of: str = "k"
    keep_first_block: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"blend selection ratio must be in (0, 1], got {self.ratio}")
        if self.check_layer < 1:
            raise ValueError(
                f"blend check layer must be >= 1 (layer 0 has no cross-chunk input), got {self.check_layer}"
            )
        if self.deviation_of not in DEVIATION_OF:
            raise ValueError(f"blend deviation must be one of {DEVIATION_OF}, got {self.deviation_of!r}")

    def num_selected(self, num_reused: int) -> int:
        """Tokens recomputed out of num_reused candidates: ceil(ratio * n), at least one when n > 0."""
        return min(num_reused, max(1, math.ceil(self.ratio * num_reused))) if num_reused else 0


def kv_deviation(
    fresh: tuple[torch.Tensor, torch.Tensor], cached: tuple[torch.Tensor, torch.Tensor], deviation_of: str = "k"
) -> torch.Tensor:
    """Per-token squared L2 distance [N] between fresh and cached (k, v), each [N, Hkv, D], in fp32."""
    (fk, fv), (ck, cv) = fresh, cached
    out = torch.zeros(fk.shape[0], dtype=torch.float32, device=fk.device)
    if deviation_of in ("k", "kv"):
        out += (fk.float() - ck.float()).pow(2).sum(dim=(-2, -1))
    if deviation_of in ("v", "kv"):
        out += (fv.float() - cv.float()).pow(2).sum(dim=(-2, -1))
    return out


def select_top(deviation: torch.Tensor, num_selected: int) -> torch.Tensor:
    """Indices (ascending, int64) of the num_selected largest deviations; ties go to the earlier token."""
    if num_selected <= 0:
        return torch.empty(0, dtype=torch.int64, device=deviation.device)
    # A stable descending sort, not topk: topk's order among equal values is unspecified, and the
    # engine and the reference must pick the same tokens.
    order = torch.sort(deviation, descending=True, stable=True).indices[:num_selected]
    return order.sort().values
