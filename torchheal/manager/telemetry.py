"""What a Manager reports about itself: Prometheus counters and the reference's log records.

The Manager calls a :class:`Telemetry` at a few points of the step (quorum applied, vote
decided, errors, aborts; heals timed through :meth:`Telemetry.recovery`). It updates
:class:`~torchheal.metrics.trainer.TrainerStats` (served on ``/metrics`` by group rank 0 when
``TORCHHEAL_METRICS_PORT`` is set) and writes the reference's structured records with the same
logger names and fields: ``torchft_quorums`` on every new quorum id and ``torchft_commits`` on
every vote (exported by :mod:`torchheal.otel` with ``TORCHFT_USE_OTEL``). A record's fields are
built only when someone listens.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from torchheal._base.telemetry_env import TelemetryEnv
from torchheal.coordination.guard_report import GuardReport
from torchheal.coordination.types import QuorumResult
from torchheal.metrics.trainer import MetricsServer, TrainerStats, serve_metrics

__all__ = ["Telemetry", "state_bytes"]

logger = logging.getLogger("torchheal.manager")

#: The reference's structured-record loggers (log pipelines match these names).
QUORUMS_LOGGER = "torchft_quorums"
COMMITS_LOGGER = "torchft_commits"
ERRORS_LOGGER = "torchft_errors"


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: what a heal moves.

    Args:
        state: dicts, lists and tuples of tensors and plain values.
    """
    total = 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item  # DTensor: its shard
            total += local.numel() * local.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


class _TimedRecovery:
    """The Manager's recovery part, with each send and receive counted and timed."""

    def __init__(self, recovery: Any, stats: TrainerStats) -> None:
        self._recovery = recovery
        self._stats = stats

    def send(self, quorum: QuorumResult, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        self._recovery.send(quorum, state)
        s = self._stats
        s.recovery_send_seconds += time.perf_counter() - start
        s.recovery_sends += 1
        s.recovery_send_bytes += state_bytes(state)

    def receive(
        self, quorum: QuorumResult, metadata: str | None = None, into: Any = None
    ) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            received = self._recovery.receive(quorum, metadata, into)
        except BaseException:
            self._stats.heal_failures += 1
            raise
        s = self._stats
        s.heal_seconds.observe(time.perf_counter() - start)
        s.heals += 1
        s.heal_bytes += state_bytes(received)
        return received

    def __getattr__(self, name: str) -> Any:
        return getattr(self._recovery, name)


class Telemetry:
    """Counters and structured records of one rank of one replica group.

    Args:
        replica_id: the user's replica id (the records' ``replica_id``, as the reference's;
            may be None).
        full_replica_id: the id registered with the lighthouse (``{replica_id}:{uuid}``); its
            name part labels the metrics.
        group_rank: this rank's index in its replica group (the records' ``rank``).
        env: the parsed environment (default: read now).
        hostname: the host name shown in the metrics URL that is logged.

    Raises:
        ValueError: a telemetry variable is malformed.
        ImportError: OpenTelemetry export is on but its packages are missing.
        RuntimeError: the metrics port could not be bound.
    """

    def __init__(
        self,
        replica_id: str | None,
        full_replica_id: str,
        group_rank: int,
        env: TelemetryEnv | None = None,
        hostname: str | None = None,
    ) -> None:
        env = env or TelemetryEnv.from_env()
        self.stats = TrainerStats()
        self._replica_id = replica_id
        self._rank = group_rank
        self._job_id = env.job_id
        self._quorums = logging.getLogger(QUORUMS_LOGGER)
        self._commits = logging.getLogger(COMMITS_LOGGER)
        if env.use_otel:
            from torchheal.otel import setup_logger

            for name in (QUORUMS_LOGGER, COMMITS_LOGGER, ERRORS_LOGGER):
                setup_logger(name, env)
        self.server: MetricsServer | None = None
        if group_rank == 0 and env.metrics_port is not None:
            name = full_replica_id.split(":", 1)[0] or full_replica_id
            self.server = serve_metrics(self.stats, name, env.metrics_port, env.metrics_host)
            logger.info(
                "[%s/%d] Prometheus metrics at %s",
                full_replica_id,
                group_rank,
                self.server.url(hostname or socket.gethostname()),
            )

    # -- training thread -------------------------------------------------------------------

    def waited(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for the quorum in flight.

        Args:
            seconds: how long it waited.
        """
        self.stats.quorum_wait_seconds += seconds

    def committed(self, step: int, quorum_id: int, commit: bool) -> None:
        """The group's vote on ``step`` was decided (before the step advances).

        Args:
            step: the step voted on.
            quorum_id: the quorum the step ran in.
            commit: the decision.
        """
        s = self.stats
        if commit:
            s.steps_committed += 1
            s.step = step + 1
        else:
            s.steps_failed += 1
        if self._commits.isEnabledFor(logging.INFO):
            self._commits.info(
                "",
                extra={
                    "job_id": self._job_id,
                    "replica_id": self._replica_id,
                    "rank": self._rank,
                    "quorum_id": quorum_id,
                    "step": step,
                    "commit_result": commit,
                },
            )

    def salvaged(self) -> None:
        """A step was redone in a new quorum after a replica group was lost in it."""
        self.stats.steps_salvaged += 1

    # -- quorum thread ---------------------------------------------------------------------

    def quorum(
        self, result: QuorumResult, previous_quorum_id: int, participants: int, seconds: float
    ) -> None:
        """A quorum was computed and its work done.

        Args:
            result: this rank's quorum result.
            previous_quorum_id: the quorum the process group was configured for before.
            participants: replica groups contributing to this step.
            seconds: the quorum work's duration on the quorum thread.
        """
        s = self.stats
        s.quorums += 1
        s.quorum_seconds.observe(seconds)
        s.quorum_size = result.replica_world_size
        s.participants = participants
        s.quorum_id = result.quorum_id
        if result.quorum_id == previous_quorum_id:
            return
        s.reconfigurations += 1
        if self._quorums.isEnabledFor(logging.INFO):
            self._quorums.info(
                "",
                extra={
                    "job_id": self._job_id,
                    "replica_id": self._replica_id,
                    "rank": self._rank,
                    "quorum_id": result.quorum_id,
                    "step": result.max_step,
                },
            )

    def quorum_failed(self) -> None:
        """The quorum request failed (the error goes to the training loop)."""
        self.stats.quorum_errors += 1

    def recovery(self, recovery: Any) -> Any:
        """``recovery`` with its sends and receives counted and timed.

        Args:
            recovery: the Manager's :class:`~torchheal.manager.recovery.Recovery`.
        """
        return _TimedRecovery(recovery, self.stats)

    # -- any thread ------------------------------------------------------------------------

    def error(self) -> None:
        """An error was reported: the step will not commit."""
        self.stats.count_error()

    def allreduce_failed(self) -> None:
        """An allreduce failed (to start, or in flight)."""
        self.stats.count_error(allreduce=True)

    def allreduce_error_counter(self) -> Callable[[Exception], None]:
        """A callback for one allreduce that counts its failure once, however often reported.

        Returns:
            ``on_error(exception)``.
        """
        seen = False

        def on_error(_: Exception) -> None:
            nonlocal seen
            if not seen:
                seen = True
                self.stats.count_error(allreduce=True)

        return on_error

    def guard_report(self) -> dict[str, int]:
        """The divergence guard's counts as group rank 0 sends them with each quorum request.

        Read on the quorum thread while the training thread counts: a report may be one
        verdict old, and the next request carries the rest.
        """
        s = self.stats
        report = GuardReport(s.last_verified_step, s.divergence_checks, s.divergence_mismatches)
        return report.to_data()

    def process_group_aborted(self) -> None:
        """The cross-replica process group was aborted."""
        self.stats.process_group_aborts += 1

    def close(self) -> None:
        """Stops serving ``/metrics``."""
        if self.server is not None:
            self.server.shutdown()
            self.server = None
