"""The chaos soak's settings and what it returns (``bench/chaos.py``)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench._chaos_check import Event, Fault
from bench._chaos_flips import Flip
from torchheal._base.manager_env import DIVERGENCE_INTERVAL_ENV, ON_DIVERGENCE_ENV


@dataclass
class ChaosConfig:
    """One soak.

    Args:
        duration_s: how long faults are injected.
        groups: replica groups.
        ranks: ranks per group.
        gap_s: seconds between faults (uniform in the range).
        stop_s: how long a group stays SIGSTOPped.
        cut_s: how long a group's lighthouse path stays stalled.
        restart_delay_s: how long a killed group stays down.
        compute_s: a sleep per step standing for accelerator time.
        timeout_s: the ranks' collective and commit timeout.
        heartbeat_timeout_ms: the lighthouse's.
        settle_s: after the faults, bound on every group training together again, and on the
            stop at a common step (a group that misses it hung).
        seed: the faults' random seed.
        workdir: logs, the target file, the final states (below).
        log_level: the ranks' and the lighthouse's logging level.
        flip_every_s: flip one bit of one parameter of one rank this often (None: never);
            every flip must be reported by the divergence guard (``_chaos_flips.py``).
        flip_report_s: how long a flip may go unreported before the soak counts it missed and
            moves on (other faults wait meanwhile, so that nothing but the flip can explain a
            mismatch or erase the flip).
        check_interval: the ranks' divergence guard interval
            (``TORCHHEAL_DIVERGENCE_CHECK_INTERVAL``; None: 1 with flips, else the environment's),
            its policy ``repair``.

    The workdir keeps what a failure is diagnosed from: ``lighthouse.log`` (the in-process
    lighthouse's lines: quorums issued, members lost, sessions), ``events.jsonl`` (every rank's
    events as they arrive, tagged with group, start and rank) and ``g{group}i{start}r{rank}.log``
    (each rank's own lines: its manager's quorums, heals, aborts; rank 0's manager server).
    """

    duration_s: float = 600.0
    groups: int = 3
    ranks: int = 2
    gap_s: tuple[float, float] = (5.0, 15.0)
    stop_s: tuple[float, float] = (2.0, 8.0)
    cut_s: tuple[float, float] = (6.0, 10.0)
    restart_delay_s: float = 1.0
    compute_s: float = 0.02
    timeout_s: float = 30.0
    heartbeat_timeout_ms: int = 5000
    settle_s: float = 180.0
    seed: int = 0
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="chaos-")))
    log_level: str = "INFO"
    flip_every_s: float | None = None
    flip_report_s: float = 30.0
    check_interval: int | None = None

    def guard_env(self) -> dict[str, str]:
        """The ranks' guard settings, over the soak's own environment."""
        interval = self.check_interval
        if interval is None and self.flip_every_s is not None:
            interval = 1
        if interval is None:
            return {}
        return {DIVERGENCE_INTERVAL_ENV: str(interval), ON_DIVERGENCE_ENV: "repair"}


@dataclass
class ChaosResult:
    """What a soak did and found.

    Args:
        faults: every fault injected, measured.
        events: every rank's events (``group``, ``inc``, ``rank`` added).
        steps: the job's committed steps.
        problems: every broken promise (empty: all is well).
        unplanned_exits: ``(group, start, exit codes)`` of starts that died by themselves.
        flips: every bit flipped, with its report (``--flip-every``).
        started: when the faults began (wall clock), for the flips' times.
        identical: every group ended bit-identical (None: not compared, after a hang).
    """

    faults: list[Fault]
    events: list[Event]
    steps: int
    problems: list[str]
    unplanned_exits: list[tuple[int, int, dict[int, int]]]
    flips: list[Flip] = field(default_factory=list)
    started: float = 0.0
    identical: bool | None = None
