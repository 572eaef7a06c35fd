"""Local launcher: run N replica groups of a training command, inject failures, restart the dead.

This is what ``torchheal launch`` and ``torchheal demo`` use. It starts a lighthouse in this
process (unless one is given), starts one process per replica group with the environment a
torchheal job expects (``TORCHHEAL_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``),
reads their output line by line, and restarts any group that dies — the way torchrun's
``--max_restarts`` would on a real cluster. Failures are injected with SIGKILL, the harshest
kind: no cleanup, sockets torn down by the kernel.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torchheal.launcher.events import Event, parse

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KillPlan:
    """When to inject failures.

    Args:
        every_s: kill a group every this many seconds (None: never on a timer).
        at_step: kill once, as soon as any group reports this committed step (None: never).
        victims: groups that may be killed, taken in turn. Group 0 is spared by default so the
            job always keeps one group that has never failed.
        max_kills: stop injecting after this many kills.
    """

    every_s: float | None = None
    at_step: int | None = None
    victims: tuple[int, ...] = ()
    max_kills: int = 1_000_000


@dataclass
class GroupProcess:
    """One replica group's current process and its history."""

    group: int
    proc: subprocess.Popen | None = None
    starts: list[float] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class RunResult:
    """Everything a run produced, for summaries and tests."""

    events: list[Event]
    groups: dict[int, GroupProcess]
    started: float
    ended: float
    timed_out: bool


class Launcher:
    """Runs ``replicas`` copies of ``command`` as replica groups until every one exits cleanly.

    A group whose process exits with a non-zero code or a signal is restarted after
    ``restart_delay_s``; one that exits with 0 is done.

    Args:
        command: argv of one replica group's process.
        replicas: number of replica groups.
        lighthouse_addr: address of the lighthouse every group joins.
        kill_plan: failure injection schedule.
        restart_delay_s: how long a dead group stays down before it is restarted.
        deadline_s: give up (and end every process) after this many seconds.
        on_event: called for each progress event, in arrival order.
        on_output: called with (group, line) for every non-event output line.
        on_kill: called with (group, reason) just before a failure is injected.
        env: extra environment for every group.
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
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        if not command:
            raise ValueError("command must not be empty")
        self._command = list(command)
        self._replicas = replicas
        self._lighthouse_addr = lighthouse_addr
        self._plan = kill_plan or KillPlan()
        self._restart_delay_s = restart_delay_s
        self._deadline_s = deadline_s
        self._on_event = on_event or (lambda e: None)
        self._on_output = on_output or (lambda g, line: None)
        self._on_kill = on_kill or (lambda g, reason: None)
        self._env = dict(env or {})
        self._lines: queue.Queue[tuple[int, int, str | None]] = queue.Queue()
        self._groups = {i: GroupProcess(i) for i in range(replicas)}
        self._events: list[Event] = []
        victims = self._plan.victims or tuple(range(1, replicas)) or (0,)
        self._victims = [v for v in victims if 0 <= v < replicas]
        self._kill_count = 0
        self._step_kill_done = False

    def _start(self, g: GroupProcess) -> None:
        env = {
            **os.environ,
            **self._env,
            "TORCHHEAL_LIGHTHOUSE": self._lighthouse_addr,
            "REPLICA_GROUP_ID": str(g.group),
            "NUM_REPLICA_GROUPS": str(self._replicas),
            "PYTHONUNBUFFERED": "1",
        }
        g.proc = subprocess.Popen(
            self._command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        g.starts.append(time.time())
        generation = len(g.starts)
        threading.Thread(
            target=self._pump,
            args=(g.group, generation, g.proc),
            name=f"launch-pump-{g.group}",
            daemon=True,
        ).start()

    def _pump(self, group: int, generation: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.put((group, generation, line.rstrip("\n")))
        self._lines.put((group, generation, None))  # end of output: the process is exiting

    def _kill(self, group: int, reason: str) -> None:
        g = self._groups[group]
        if g.proc is None or g.proc.poll() is not None or g.done:
            return
        logger.info("killing group %d (pid %d): %s", group, g.proc.pid, reason)
        self._on_kill(group, reason)
        g.proc.send_signal(signal.SIGKILL)
        g.kills.append(time.time())
        self._kill_count += 1

    def _next_victim(self) -> int | None:
        if not self._victims or self._kill_count >= self._plan.max_kills:
            return None
        return self._victims[self._kill_count % len(self._victims)]

    def run(self) -> RunResult:
        """Start every group and drive the run to its end; always ends every process it started."""
        started = time.time()
        for g in self._groups.values():
            self._start(g)
        restart_at: dict[int, float] = {}
        next_timer_kill = started + self._plan.every_s if self._plan.every_s else None
        timed_out = False
        try:
            while not all(g.done for g in self._groups.values()):
                now = time.time()
                if now - started > self._deadline_s:
                    timed_out = True
                    break
                if next_timer_kill is not None and now >= next_timer_kill:
                    victim = self._next_victim()
                    if victim is not None:
                        self._kill(victim, f"timer ({self._plan.every_s}s)")
                    next_timer_kill = now + (self._plan.every_s or 0)
                for group, when in list(restart_at.items()):
                    if now >= when:
                        del restart_at[group]
                        self._start(self._groups[group])
                try:
                    group, generation, line = self._lines.get(timeout=0.05)
                except queue.Empty:
                    continue
                g = self._groups[group]
                if generation != len(g.starts):
                    continue  # late output of a process we already replaced
                if line is None:
                    assert g.proc is not None
                    code = g.proc.wait(timeout=30)
                    g.exit_codes.append(code)
                    if code == 0:
                        g.done = True  # finished its work; a clean exit is never restarted
                    elif not g.done:
                        restart_at[group] = time.time() + self._restart_delay_s
                    continue
                event = parse(line)
                if event is None:
                    self._on_output(group, line)
                    continue
                self._events.append(event)
                if event.kind == "done":
                    g.done = True
                self._on_event(event)
                if (
                    event.kind == "step"
                    and self._plan.at_step is not None
                    and not self._step_kill_done
                    and int(event.fields.get("step", 0)) >= self._plan.at_step
                ):
                    victim = self._next_victim()
                    if victim is not None:
                        self._step_kill_done = True
                        self._kill(victim, f"reached step {self._plan.at_step}")
        finally:
            for g in self._groups.values():
                if g.proc is None or g.proc.poll() is not None:
                    continue
                if g.done and not timed_out:
                    try:  # it reported done and is shutting down: give it a moment
                        g.proc.wait(timeout=10)
                        continue
                    except subprocess.TimeoutExpired:
                        pass
                g.proc.kill()
                g.proc.wait(timeout=30)
            for g in self._groups.values():
                # Record the exit of processes that ended after the loop stopped reading.
                if (
                    g.proc is not None
                    and len(g.exit_codes) < len(g.starts)
                    and g.proc.returncode is not None
                ):
                    g.exit_codes.append(g.proc.returncode)
        return RunResult(
            events=self._events,
            groups=self._groups,
            started=started,
            ended=time.time(),
            timed_out=timed_out,
        )


def python_module_command(module: str, *args: str) -> list[str]:
    """argv that runs ``module`` with this interpreter (so the child sees the same packages)."""
    return [sys.executable, "-m", module, *args]
