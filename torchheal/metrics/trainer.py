"""A trainer's Prometheus metrics (``torchheal_trainer_*``), served by a replica group's rank 0.

:class:`TrainerStats` holds plain numbers, so a step costs a few additions;
:class:`TrainerCollector` turns them into metric families at scrape time. Each field has one
writer thread, except errors, which any thread may report: :meth:`TrainerStats.count_error`
takes a lock for those (rare, so free).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torchheal.metrics.exposition import _prometheus, histogram_family
from torchheal.metrics.stats import Histogram

__all__ = ["MetricsServer", "TrainerCollector", "TrainerStats", "serve_metrics"]

# Heals move whole state dicts: from a fraction of a second to minutes.
TRANSFER_BUCKETS_S: tuple[float, ...] = (
    0.01,
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
    600.0,
)


class TrainerStats:
    """Counters of one rank's fault-tolerance work; every field is a plain number."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Steps this replica group committed.
        self.steps_committed = 0
        #: Steps it voted on and did not commit.
        self.steps_failed = 0
        #: Steps redone without error in a new quorum after a group was lost in them.
        self.steps_salvaged = 0
        #: The step the replica group is at (its committed steps, heals included).
        self.step = 0
        #: Quorums this rank took part in, and their duration on the quorum thread.
        self.quorums = 0
        self.quorum_seconds = Histogram()
        #: Quorum requests that failed (raised to the training loop).
        self.quorum_errors = 0
        #: Seconds the training thread waited for the quorum beyond the forward pass.
        self.quorum_wait_seconds = 0.0
        #: Quorums with a new id, for which the cross-replica process group was rebuilt.
        self.reconfigurations = 0
        #: The last quorum: its id, its replica groups, the groups contributing to the step.
        self.quorum_id = -1
        self.quorum_size = 0
        self.participants = 0
        #: Heals from a peer's state, their bytes and seconds; heals that failed.
        self.heals = 0
        self.heal_bytes = 0
        self.heal_seconds = Histogram(TRANSFER_BUCKETS_S)
        self.heal_failures = 0
        #: State sent to healing peers: transfers, bytes, seconds.
        self.recovery_sends = 0
        self.recovery_send_bytes = 0
        self.recovery_send_seconds = 0.0
        #: Errors that made a step fail (every kind), and how many of them an allreduce raised.
        self.errors = 0
        self.allreduce_errors = 0
        #: Times the cross-replica process group was aborted.
        self.process_group_aborts = 0
        #: Divergence guard: comparisons, mismatches, and the last step all groups agreed.
        self.divergence_checks = 0
        self.divergence_mismatches = 0
        self.last_verified_step = -1

    def count_error(self, allreduce: bool = False) -> None:
        """Counts one step error, from an allreduce or not (from any thread)."""
        with self._lock:
            if allreduce:
                self.allreduce_errors += 1
            else:
                self.errors += 1


@dataclass(frozen=True)
class _Family:
    kind: str  # "counter" | "gauge"
    name: str  # also the TrainerStats field
    doc: str


_FAMILIES: tuple[_Family, ...] = (
    _Family("counter", "steps_committed", "Steps the replica group committed."),
    _Family("counter", "steps_failed", "Steps the replica group voted on and did not commit."),
    _Family(
        "counter",
        "steps_salvaged",
        "Steps redone in a new quorum after a replica group was lost during them.",
    ),
    _Family("counter", "quorums", "Quorums this rank took part in."),
    _Family("counter", "quorum_errors", "Quorum requests that failed (raised to training)."),
    _Family(
        "counter",
        "quorum_wait_seconds",
        "Seconds the training thread waited for the quorum beyond the forward pass.",
    ),
    _Family(
        "counter",
        "reconfigurations",
        "New quorum ids, each rebuilding the cross-replica process group.",
    ),
    _Family("counter", "heals", "Times this replica group healed from a peer's state."),
    _Family("counter", "heal_bytes", "Bytes of state received when healing."),
    _Family("counter", "heal_failures", "Heals that failed (the step did not commit)."),
    _Family("counter", "recovery_sends", "State transfers sent to healing peers."),
    _Family("counter", "recovery_send_bytes", "Bytes of state sent to healing peers."),
    _Family("counter", "recovery_send_seconds", "Seconds spent sending state to healing peers."),
    _Family("counter", "errors", "Errors that made a step fail (allreduce errors included)."),
    _Family("counter", "allreduce_errors", "Allreduce errors (each fails its step)."),
    _Family("counter", "process_group_aborts", "Aborts of the cross-replica process group."),
    _Family(
        "counter", "divergence_checks", "Comparisons of the replica groups' state fingerprints."
    ),
    _Family(
        "counter",
        "divergence_mismatches",
        "Comparisons that found replica groups holding different state.",
    ),
    _Family(
        "gauge",
        "last_verified_step",
        "Last step at which every compared replica group held the same state (-1: none).",
    ),
    _Family("gauge", "step", "The step the replica group is at."),
    _Family("gauge", "quorum_id", "Id of the last quorum (-1 before the first)."),
    _Family("gauge", "quorum_size", "Replica groups in the last quorum."),
    _Family("gauge", "participants", "Replica groups contributing to the current step."),
)


class TrainerCollector:
    """Yields a trainer's metric families on each scrape, labelled with its replica group.

    Args:
        stats: the counters.
        replica_id: the replica group's name (the ``replica_id`` label).
    """

    def __init__(self, stats: TrainerStats, replica_id: str) -> None:
        self._stats = stats
        self._labels = {"replica_id": replica_id}

    def collect(self) -> Iterator[Any]:
        """The metric families, as prometheus-client's registry asks for them."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._stats
        label_names = list(self._labels)
        label_values = list(self._labels.values())
        for f in _FAMILIES:
            cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
            # prometheus-client appends "_total" to counter names.
            family = cls(f"torchheal_trainer_{f.name}", f.doc, labels=label_names)
            family.add_metric(label_values, float(getattr(s, f.name)))
            yield family
        yield histogram_family(
            "torchheal_trainer_quorum_duration_seconds",
            "Quorum work per step on the quorum thread: request, rebuild, state transfer.",
            s.quorum_seconds.snapshot(),
            self._labels,
        )
        yield histogram_family(
            "torchheal_trainer_heal_duration_seconds",
            "Seconds each heal took, from asking the source to holding its state.",
            s.heal_seconds.snapshot(),
            self._labels,
        )


class MetricsServer:
    """``/metrics`` of a registry over HTTP, on a daemon thread; starts in the constructor.

    Args:
        registry: a ``prometheus_client`` registry.
        port: TCP port; 0 picks a free one.
        host: the address to listen on ("": every IPv4 address; ``::``: every address).

    Raises:
        RuntimeError: the port could not be bound.
    """

    def __init__(self, registry: Any, port: int = 0, host: str = "") -> None:
        prom = _prometheus()
        try:
            self._httpd, self._thread = prom.start_http_server(
                port, addr=host or "0.0.0.0", registry=registry
            )
        except OSError as e:
            raise RuntimeError(
                f"cannot serve /metrics on {host or '0.0.0.0'}:{port}: {e.strerror or e}; "
                "choose another port (TORCHHEAL_METRICS_PORT, 0 picks a free one)"
            ) from None
        self.port: int = int(self._httpd.server_address[1])

    def url(self, host: str) -> str:
        """``http://{host}:{port}/metrics``."""
        target = f"[{host}]" if ":" in host else host
        return f"http://{target}:{self.port}/metrics"

    def shutdown(self) -> None:
        """Stops serving and closes the socket (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()


def serve_metrics(stats: TrainerStats, replica_id: str, port: int, host: str = "") -> MetricsServer:
    """Serves a trainer's metrics (and its process's own) on ``host:port``.

    Args:
        stats: the trainer's counters.
        replica_id: the ``replica_id`` label.
        port: TCP port; 0 picks a free one.
        host: the address to listen on (default: every IPv4 address).

    Raises:
        RuntimeError: the port could not be bound.
    """
    from torchheal.metrics.exposition import new_registry

    return MetricsServer(new_registry(TrainerCollector(stats, replica_id)), port, host)
