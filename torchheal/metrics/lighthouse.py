"""The lighthouse's Prometheus metrics (``torchheal_lighthouse_*``).

Counters come from the lighthouse's observer (duck-typed, so this leaf package imports nothing
of torchheal); gauges of the present come from ``LighthouseServer.status()`` at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torchheal.metrics.exposition import histogram_family
from torchheal.metrics.stats import Histogram

__all__ = ["LighthouseCollector", "LighthouseCounters"]


class LighthouseCounters(Protocol):
    """What the collector reads from the lighthouse's observer."""

    heartbeats: int
    requests: int
    rounds: int
    round_seconds: Histogram
    members_lost: int
    members_joined: int
    expirations: int
    quorum_id: int
    quorum_size: int
    max_step: int


class LighthouseCollector:
    """Yields the lighthouse's metric families on each scrape.

    Args:
        counters: the lighthouse observer's counters.
        status: returns ``LighthouseServer.status()`` (called once per scrape).
    """

    def __init__(self, counters: LighthouseCounters, status: Callable[[], dict[str, Any]]) -> None:
        self._counters = counters
        self._status = status

    def collect(self) -> Iterator[Any]:
        """The metric families, as prometheus-client's registry asks for them."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self._counters
        status = self._status()
        timeout_s = status["config"]["heartbeat_timeout_ms"] / 1000.0
        heartbeating = sum(1 for age in status["heartbeats"].values() if age < timeout_s)

        def counter(name: str, doc: str, value: float) -> Any:
            return CounterMetricFamily(f"torchheal_lighthouse_{name}", doc, value=value)

        def gauge(name: str, doc: str, value: float) -> Any:
            return GaugeMetricFamily(f"torchheal_lighthouse_{name}", doc, value=value)

        # prometheus-client appends "_total" to counter names.
        yield counter("heartbeats", "Heartbeats received from replica groups.", c.heartbeats)
        yield counter("quorum_requests", "Quorum requests received.", c.requests)
        yield counter("quorum_rounds", "Quorums issued (one per round).", c.rounds)
        yield histogram_family(
            "torchheal_lighthouse_quorum_round_duration_seconds",
            "Time from a round's first quorum request to the quorum being issued.",
            c.round_seconds.snapshot(),
        )
        yield counter(
            "members_lost", "Quorum members that were not in the next quorum.", c.members_lost
        )
        yield counter(
            "members_joined",
            "Quorum members that were not in the previous quorum.",
            c.members_joined,
        )
        yield counter("heartbeats_expired", "Replicas whose heartbeat expired.", c.expirations)
        yield gauge("quorum_id", "Id of the last issued quorum (0 before the first).", c.quorum_id)
        yield gauge("quorum_size", "Members of the last issued quorum.", c.quorum_size)
        yield gauge("max_step", "Highest step reported in the last issued quorum.", c.max_step)
        yield gauge(
            "quorum_requests_waiting",
            "Quorum requests waiting for the next quorum.",
            len(status["waiting"]),
        )
        yield gauge(
            "replicas_heartbeating",
            "Replica groups whose last heartbeat is younger than the heartbeat timeout.",
            heartbeating,
        )
        yield gauge(
            "min_replicas",
            "Fewest replica groups a new quorum needs.",
            status["config"]["min_replicas"],
        )
