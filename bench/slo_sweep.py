"""The highest Poisson arrival rate at which a server still meets a TTFT SLO, by bisection on the rate.

A ratio of p50 TTFTs "at capacity" depends on where the knee is taken and on how long the load runs:
past capacity the queue, and with it every TTFT, grows for as long as arrivals go on. The rate at
which a mode stops meeting an SLO is a property of the server instead: a probe meets it when its
TTFT quantile is within the SLO *and* its queue holds (the last third of its arrivals waits at most
`max_growth` times as long as the first third did), so that a longer probe would not miss it
either. Each probe is a load of its own requests, started on an idle server; the rate is bisected
geometrically between two bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Slo:
    """A TTFT service-level objective.

    Args:
        ttft_ms: the most TTFT allowed at the quantile, in milliseconds (> 0).
        quantile: which TTFT quantile (0 < q <= 1; 0.99 is p99).
        max_growth: the most queue growth (p50 TTFT of the last third of arrivals over that of the
            first third) a probe may show and still meet the SLO (>= 1).

    Raises:
        ValueError: a value out of range.
    """

    ttft_ms: float = 1000.0
    quantile: float = 0.99
    max_growth: float = 1.25

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or not 0 < self.quantile <= 1 or self.max_growth < 1:
            raise ValueError(f"an SLO needs ttft_ms > 0, 0 < quantile <= 1 and max_growth >= 1, got {self}")

    @property
    def name(self) -> str:
        q = f"p{self.quantile * 100:g}"
        return f"{q} TTFT <= {self.ttft_ms:g} ms, queue growth <= {self.max_growth:g}x"

    def miss(self, quantile_ms: float, growth: float | None) -> str | None:
        """Why a probe with this TTFT quantile and queue growth misses the SLO; None when it meets it."""
        if quantile_ms > self.ttft_ms:
            return f"p{self.quantile * 100:g} {quantile_ms:.0f} ms"
        if growth is not None and growth > self.max_growth:
            return f"queue growth {growth:.2f}x"
        return None


@dataclass(frozen=True)
class Probe:
    """One probe of the sweep: its rate (requests/s), TTFT quantile (ms), queue growth, and why it missed."""

    rate: float
    quantile_ms: float
    growth: float | None
    missed: str | None

    @property
    def met(self) -> bool:
        return self.missed is None


def sweep(run_probe: Callable[[int, float], Probe], low: float, high: float, probes: int) -> list[Probe]:
    """Bisect the rate between low and high (geometric midpoints) with `probes` probes; every probe, in order.

    run_probe(i, rate) runs probe i (0-based) at `rate` requests/s. After n probes the crossing is
    known within a factor (high / low) ** (1 / 2**n) unless it lies outside [low, high].

    Raises:
        ValueError: low <= 0, high <= low or probes < 1.
    """
    if low <= 0 or high <= low or probes < 1:
        raise ValueError(f"a sweep needs 0 < low < high and probes >= 1, got {low}, {high}, {probes}")
    out = []
    for i in range(probes):
        rate = math.sqrt(low * high)
        probe = run_probe(i, rate)
        out.append(probe)
        if probe.met:
            low = rate
        else:
            high = rate
    return out


def crossing(probes: list[Probe]) -> tuple[Probe | None, Probe | None]:
    """The fastest probe that met the SLO and the slowest that missed it (None where there is none)."""
    met = [p for p in probes if p.met]
    missed = [p for p in probes if not p.met]
    return (max(met, key=lambda p: p.rate, default=None), min(missed, key=lambda p: p.rate, default=None))
