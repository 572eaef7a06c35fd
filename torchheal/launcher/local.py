"""Local launcher: run N replica groups of K ranks, inject failures, restart the dead.

When any rank dies the launcher ends its whole group (``proctree.py``) and starts it again, as
torchrun's ``--max_restarts`` would. A group that dies several starts in a row before its first
committed step is crash-looping: the launcher stops and reports its last output lines.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchheal.launcher.events import Event, parse
from torchheal.launcher.group import GroupStart, OutputLine, common_env, describe_exit
from torchheal.launcher.progress import FirstSteps, quorum_members
from torchheal.launcher.records import GroupProcess, KillPlan, RunResult
from torchheal.launcher.spare import DEFAULT_PRELOAD, SparePool
from torchheal.launcher.spare_priority import can_preload_idle
from torchheal.launcher.spare_process import started_warm

logger = logging.getLogger(__name__)

#: Consecutive deaths before a first step after which the launcher gives up.
DEFAULT_MAX_STARTUP_FAILURES = 3
#: How long an exited rank's remaining output may take to arrive before its exit is handled.
OUTPUT_GRACE_S = 0.5


class Launcher:
    """Runs ``replicas`` replica groups of ``nproc_per_replica`` ranks each until all are done.

    A group is done when it reports a ``done`` event or every rank exits with 0. Once a group
    is done, a group that dies stays down (``stopped``): it would have no peer to heal from.

    Args:
        command: argv of every rank.
        replicas: number of replica groups.
        lighthouse_addr: the lighthouse every group joins.
        kill_plan: failure injection schedule.
        restart_delay_s: how long a dead group stays down before it is restarted.
        deadline_s: give up (and end every process) after this many seconds.
        on_event: called for each progress event (rank 0's), in arrival order.
        on_output: called with (group, line) for every other line (``[rank R] `` first when
            a group has several ranks).
        on_kill: called with (group, reason) just before a failure is injected.
        env: extra environment for every rank.
        nproc_per_replica: ranks per replica group.
        max_startup_failures: give up when a group dies this many times in a row before its
            first committed step.
        status: returns the lighthouse's status document, or None when it cannot be read.
        on_status: called with each status document read.
        status_interval_s: how often ``status`` is polled.
        startup_grace_s: without ``status``, a start up this long counts as having committed.
        on_restart: called with (group, exit code) when a dead group is scheduled to restart.
        group_env: extra environment of one group's ranks (for example its metrics port).
        warm_spares: groups' worth of warm spares kept for restarts (0: restarts start cold).
        spare_preload: modules spares import besides ``spare.DEFAULT_PRELOAD``.
        base_env: the environment every rank starts from, before ``env`` (default: this
            process's); a command line's settings reach the ranks here.
    """

    def __init__(
        self,
        command: Sequence[str],
        replicas: int,
        lighthouse_addr: str,
        kill_plan: KillPlan | None = None,
        restart_delay_s: float = 1.0,
        deadline_s: float = 600.0,
        on_event: Callable[[Event], None] | None = None,
        on_output: Callable[[int, str], None] | None = None,
        on_kill: Callable[[int, str], None] | None = None,
        env: dict[str, str] | None = None,
        nproc_per_replica: int = 1,
        max_startup_failures: int = DEFAULT_MAX_STARTUP_FAILURES,
        status: Callable[[], dict[str, Any] | None] | None = None,
        on_status: Callable[[dict[str, Any] | None], None] | None = None,
        status_interval_s: float = 1.0,
        startup_grace_s: float = 60.0,
        on_restart: Callable[[int, int], None] | None = None,
        group_env: Callable[[int], dict[str, str]] | None = None,
        warm_spares: int = 0,
        spare_preload: Sequence[str] = (),
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if nproc_per_replica < 1:
            raise ValueError(f"nproc_per_replica must be >= 1, got {nproc_per_replica}")
        if max_startup_failures < 1:
            raise ValueError(f"max_startup_failures must be >= 1, got {max_startup_failures}")
        if not command:
            raise ValueError("command must not be empty")
        self._command = list(command)
        self._replicas = replicas
        self._nproc = nproc_per_replica
        self._lighthouse_addr = lighthouse_addr
        self._plan = kill_plan or KillPlan()
        self._restart_delay_s = restart_delay_s
        self._deadline_s = deadline_s
        self._on_event = on_event or (lambda e: None)
        self._on_output = on_output or (lambda g, line: None)
        self._on_kill = on_kill or (lambda g, reason: None)
        self._on_restart = on_restart or (lambda g, code: None)
        self._env = dict(env or {})
        self._base_env: Mapping[str, str] = os.environ if base_env is None else dict(base_env)
        self._group_env = group_env or (lambda group: {})
        self._max_startup_failures = max_startup_failures
        self._status = status
        self._on_status = on_status or (lambda doc: None)
        self._status_interval_s = status_interval_s
        self._startup_grace_s = startup_grace_s
        self._lines: queue.Queue[OutputLine] = queue.Queue()
        self._groups = {i: GroupProcess(i) for i in range(replicas)}
        self._events: list[Event] = []
        victims = self._plan.victims or tuple(range(1, replicas)) or (0,)
        self._victims = [v for v in victims if 0 <= v < replicas]
        self._kill_count = 0
        self._step_kill_done = False
        self._job_step = 0  # the highest step a group reported
        self._first_steps = FirstSteps()
        self._error: str | None = None
        self._run_id = f"torchheal-launch-{uuid.uuid4().hex[:8]}"
        base = common_env({**self._base_env, **self._env}, nproc_per_replica)
        size, preload = warm_spares * nproc_per_replica, (*DEFAULT_PRELOAD, *spare_preload)
        self._spares = SparePool(self._command, size, env=base, preload=preload)

    @property
    def groups(self) -> dict[int, GroupProcess]:
        """Each group's history so far (read it from the thread that runs :meth:`run`)."""
        return self._groups

    def _start(self, g: GroupProcess) -> None:
        g.killed = False
        g.stepped = False
        g.current = GroupStart(
            group=g.group,
            incarnation=len(g.starts) + 1,
            command=self._command,
            nproc=self._nproc,
            replicas=self._replicas,
            lighthouse=self._lighthouse_addr,
            base_env={**self._base_env, **self._env, **self._group_env(g.group)},
            lines=self._lines,
            run_id=self._run_id,
            spawn=self._spares.spawn if g.starts else None,  # spares are for restarts
        )
        g.warm_starts += bool(g.starts) and all(map(started_warm, g.current.procs))
        g.proc = g.current.procs[0]
        g.starts.append(g.current.started)
        g.store_addresses.append(g.current.store_address)

    def _kill(self, group: int, reason: str) -> None:
        g = self._groups[group]
        if g.current is None or g.done or not g.current.running():
            return
        logger.info("killing group %d: %s", group, reason)
        self._on_kill(group, reason)
        g.killed = True
        g.current.kill()
        g.kills.append(time.time())
        self._kill_count += 1

    def _finished(self) -> bool:
        """Some group finished the job's work (the job is ending)."""
        return any(g.done for g in self._groups.values())

    def _next_victim(self) -> int | None:
        if not self._victims or self._kill_count >= self._plan.max_kills or self._finished():
            return None
        return self._victims[self._kill_count % len(self._victims)]

    def _end(self, g: GroupProcess) -> int:
        """Ends the current start (every rank and what they started); returns its exit code."""
        start = g.current
        assert start is not None
        start.kill()
        start.reap()
        start.close()
        self._first_steps.forget(start.store_address)
        g.current = None
        codes = [start.exit_codes[r] for r in sorted(start.exit_codes)]
        return next((c for c in codes if c != 0), 0)

    def _rank_exited(self, g: GroupProcess, rank: int) -> float | None:
        """A rank's output ended; returns when to restart the group, if it must be."""
        start = g.current
        assert start is not None
        try:
            code = start.procs[rank].wait(timeout=30)
        except subprocess.TimeoutExpired:
            # Output closed but the process lingers (it closed stdout itself): end it.
            start.kill()
            code = start.procs[rank].wait(timeout=30)
        start.exit_codes[rank] = code
        if code == 0 and len(start.exit_codes) < len(start.procs):
            return None  # a rank finished; the others are finishing too
        if code == 0:
            g.exit_codes.append(self._end(g))
            g.finish()  # finished its work; a clean exit is never restarted
            return None
        tail = list(start.tail)
        started = start.started
        self._end(g)
        g.exit_codes.append(code)  # the rank that died first says why, not those we ended
        if g.done:
            return None  # it reported done; a messy exit afterwards changes nothing
        if not g.killed:
            g.crashes += 1
            stepped = g.stepped or (
                self._status is None and time.time() - started >= self._startup_grace_s
            )
            g.startup_failures = 0 if stepped else g.startup_failures + 1
            if g.startup_failures >= self._max_startup_failures:
                self._error = _crash_loop_message(g, code, tail)
                return None
        if self._finished():
            g.stopped = True
            return None
        self._on_restart(g.group, code)
        return time.time() + self._restart_delay_s

    def _poll_status(self) -> None:
        assert self._status is not None
        try:
            doc = self._status()
        except Exception:
            logger.debug("reading the lighthouse status failed", exc_info=True)
            doc = None
        if doc is not None:
            self._first_steps.observe(quorum_members(doc))
            for g in self._groups.values():
                if g.current is not None and self._first_steps.stepped(g.current.store_address):
                    g.stepped = True
        self._on_status(doc)

    def _handle(self, line: OutputLine, restart_at: dict[int, float]) -> None:
        g = self._groups[line.group]
        start = g.current
        if start is None or line.incarnation != start.incarnation:
            return  # late output of a start we already ended
        if line.text is None:
            if line.rank not in start.exit_codes:
                self._exited(g, line.rank, restart_at)
            return
        prefix = f"[rank {line.rank}] " if self._nproc > 1 else ""
        start.tail.append(prefix + line.text)
        event = parse(line.text) if line.rank == 0 else None
        if event is None:
            self._on_output(g.group, prefix + line.text)
            return
        self._events.append(event)
        if event.kind == "done":
            g.finish()
        if event.kind == "step" and event.fields.get("committed"):
            g.stepped = True
        self._on_event(event)
        if event.kind == "step":
            self._job_step = max(self._job_step, int(event.fields.get("step", 0)))
        if (
            event.kind == "step"
            and self._plan.at_step is not None
            and not self._step_kill_done
            and self._job_step >= self._plan.at_step
            and all(g.stepped for g in self._groups.values())
        ):
            victim = self._next_victim()
            if victim is not None:
                self._step_kill_done = True
                self._kill(victim, f"the job reached step {self._job_step}")

    def _exited(self, g: GroupProcess, rank: int, restart_at: dict[int, float]) -> None:
        when = self._rank_exited(g, rank)
        if when is not None:
            restart_at[g.group] = when

    def _check_exits(self, now: float, restart_at: dict[int, float]) -> None:
        """Notice ranks that exited while a child they left behind still holds their output.

        The output's end is given a moment to arrive first, so a last traceback is not lost.
        """
        for g in self._groups.values():
            start = g.current
            if start is None:
                continue
            for rank, proc in enumerate(start.procs):
                if rank in start.exit_codes or proc.poll() is None:
                    continue
                seen = start.exit_seen.setdefault(rank, now)
                if now - seen >= OUTPUT_GRACE_S:
                    self._exited(g, rank, restart_at)
                    if g.current is not start:
                        break  # the group was ended (and maybe restarted)

    def run(self) -> RunResult:
        """Start every group and drive the run to its end; always ends every process it started."""
        started = time.time()
        restart_at: dict[int, float] = {}
        next_timer_kill = started + self._plan.every_s if self._plan.every_s else None
        next_status = started
        next_exit_check = started
        timed_out = False
        try:
            for g in self._groups.values():
                self._start(g)
            if can_preload_idle():
                # Spares import at idle priority beside the groups' start-up, so an early
                # failure finds them ready; otherwise they wait until the job trains (below).
                self._spares.fill()
            while self._error is None and not all(
                g.done or g.stopped for g in self._groups.values()
            ):
                now = time.time()
                if now - started > self._deadline_s:
                    timed_out = True
                    break
                if next_timer_kill is not None and now >= next_timer_kill:
                    victim = self._next_victim()
                    if victim is None or self._groups[victim].stepped:
                        if victim is not None:
                            self._kill(victim, f"timer ({self._plan.every_s}s)")
                        next_timer_kill = now + (self._plan.every_s or 0)
                    # else wait for the victim's first commit: a kill while it starts exercises
                    # no recovery, and a short timer would keep it from ever training.
                for group, when in list(restart_at.items()):
                    if self._finished():  # the job ended while this group was down
                        del restart_at[group]
                        self._groups[group].stopped = True
                    elif now >= when and not self._spares.preparing():
                        # A spare on its way is waited for here, not in spawn, so a job that
                        # ends meanwhile restarts nobody.
                        del restart_at[group]
                        self._start(self._groups[group])
                if all(g.done or g.stopped or g.stepped for g in self._groups.values()):
                    self._spares.fill()  # the job trains: the CPU a spare takes is spare
                if self._status is not None and now >= next_status:
                    next_status = now + self._status_interval_s
                    self._poll_status()
                try:
                    line = self._lines.get(timeout=0.05)
                except queue.Empty:
                    self._check_exits(now, restart_at)
                    continue
                self._handle(line, restart_at)
                if now >= next_exit_check:
                    next_exit_check = now + 0.1
                    self._check_exits(now, restart_at)
        finally:
            self._end_all(timed_out)
            self._spares.close()
        return RunResult(
            events=self._events,
            groups=self._groups,
            started=started,
            ended=time.time(),
            timed_out=timed_out,
            error=self._error,
        )

    def _end_all(self, timed_out: bool) -> None:
        for g in self._groups.values():
            start = g.current
            if start is None:
                continue
            if g.done and not timed_out and self._error is None:
                # It reported done and is shutting down: give it a moment.
                deadline = time.time() + 10
                while start.running() and time.time() < deadline:
                    time.sleep(0.05)
            code = self._end(g)
            if len(g.exit_codes) < len(g.starts):
                g.exit_codes.append(code)


def _crash_loop_message(g: GroupProcess, code: int, tail: list[str]) -> str:
    lines = [
        f"replica group {g.group} died {g.startup_failures} times in a row before its first "
        f"step (last: {describe_exit(code)}); not restarting it. Its last output lines:",
        *(f"    {line}" for line in tail),
    ]
    if not tail:
        lines.append("    (it printed nothing)")
    return "\n".join(lines)


def python_module_command(module: str, *args: str) -> list[str]:
    """argv that runs ``module`` with this interpreter (so the child sees the same packages)."""
    return [sys.executable, "-m", module, *args]
