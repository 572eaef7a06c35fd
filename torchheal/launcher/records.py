"""What a launcher run is told and what it records: the kill plan, each group's history, the result."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from torchheal.launcher.events import Event
from torchheal.launcher.group import GroupStart

__all__ = ["GroupProcess", "KillPlan", "RunResult"]


@dataclass(frozen=True)
class KillPlan:
    """When to inject failures.

    Args:
        every_s: kill a group every this many seconds (None: never on a timer); a kill due
            before its victim committed a step since its last start waits for that step.
        at_step: kill once, when a group reports this committed step and every group has
            committed one (a failure before the whole job trains shows nothing; None: never).
        victims: groups that may be killed, in turn (default: all but group 0, so the job
            keeps one group that never failed).
        max_kills: stop injecting after this many kills.
    """

    every_s: float | None = None
    at_step: int | None = None
    victims: tuple[int, ...] = ()
    max_kills: int = 1_000_000


@dataclass
class GroupProcess:
    """One replica group's current start and its history.

    Args:
        group: the group index.
        proc: rank 0's process of the current (or last) start.
        starts: wall-clock time of each start.
        kills: wall-clock time of each injected failure.
        exit_codes: per ended start, the first non-zero exit code among its ranks (negative:
            a signal), or 0.
        done: the group finished its work (it is not restarted).
        crashes: starts that died on their own.
        startup_failures: crashes in a row before a first committed step.
        store_addresses: the TCPStore address of each start.
        done_at: when it finished.
        stopped: it died after another group had finished, so it was not restarted.
        warm_starts: restarts whose every rank began in a warm spare.
    """

    group: int
    proc: subprocess.Popen[str] | None = None
    starts: list[float] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    done: bool = False
    crashes: int = 0
    startup_failures: int = 0
    store_addresses: list[str] = field(default_factory=list)
    current: GroupStart | None = None
    killed: bool = False  # the current start was killed by the launcher
    stepped: bool = False  # the current start committed a step
    done_at: float | None = None  # wall-clock time it finished
    stopped: bool = False  # died after another group had finished: not restarted
    warm_starts: int = 0

    def finish(self) -> None:
        """Marks the group as done (once)."""
        if not self.done:
            self.done = True
            self.done_at = time.time()


@dataclass
class RunResult:
    """Everything a run produced, for summaries and tests.

    Args:
        events: the progress events, in arrival order.
        groups: each group's history.
        started: wall-clock start.
        ended: wall-clock end.
        timed_out: the deadline ended the run.
        error: why the launcher gave up (a crash-looping group), or None.
    """

    events: list[Event]
    groups: dict[int, GroupProcess]
    started: float
    ended: float
    timed_out: bool
    error: str | None = None
