"""Plain, dependency-free metric values the instrumented code updates on its hot paths.

Updates take no lock: each value has one writer, and a scrape reads it at most one update old.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

__all__ = ["LATENCY_BUCKETS_S", "Histogram", "HistogramSnapshot"]

# Upper bounds in seconds, from a fast local quorum round to minutes of waiting for stragglers.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


@dataclass(frozen=True)
class HistogramSnapshot:
    """A consistent copy of a histogram (``cumulative``: observations <= each bound, then the
    total, the ``+Inf`` bucket)."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        """Number of observations."""
        return self.cumulative[-1]


class Histogram:
    """Counts observations into fixed buckets, as a Prometheus histogram does.

    Args:
        bounds: finite bucket upper bounds, strictly increasing (default: latency buckets).
    """

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        if not bounds or any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing, got {bounds!r}")
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation."""
        # bisect_left: a value equal to a bound belongs to that bucket (``le`` semantics).
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        """A copy whose buckets and count agree with each other (the sum may lag by one)."""
        counts = list(self._counts)
        cumulative = []
        total = 0
        for c in counts:
            total += c
            cumulative.append(total)
        return HistogramSnapshot(self._bounds, tuple(cumulative), self._sum)
