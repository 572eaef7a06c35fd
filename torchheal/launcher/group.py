"""One start of one replica group: a torchrun-like job of K ranks on this machine.

Each start (an *incarnation*) gets torchrun's per-rank variables, torchheal's, and a fresh
TCPStore hosted here, so a restarted group never finds the previous start's keys.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchheal.launcher.proctree import kill_trees

__all__ = ["GroupStart", "OutputLine", "common_env", "describe_exit", "rank_env"]

#: How many of a group's last output lines are kept, to explain why it died.
TAIL_LINES = 20
#: Marks every process of one group start (inherited by whatever its ranks start), so the
#: launcher can end those that outlived their parent (see ``proctree``).
MARKER_ENV = "TORCHHEAL_LAUNCH_START"


@dataclass(frozen=True)
class OutputLine:
    """One line a rank printed, or the end of its output (``text`` None: it is exiting)."""

    group: int
    incarnation: int
    rank: int
    text: str | None


def rank_env(
    base: Mapping[str, str],
    *,
    group: int,
    replicas: int,
    rank: int,
    nproc: int,
    master_addr: str,
    master_port: int,
    lighthouse: str,
    restart_count: int,
    run_id: str,
    marker: str = "",
) -> dict[str, str]:
    """The environment of one rank, as torchrun would set it (one node per group), plus
    torchheal's variables; ``marker`` is this start's :data:`MARKER_ENV` value."""
    env = common_env(base, nproc)
    env.update(
        {
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHHEAL_LIGHTHOUSE": lighthouse,
            "REPLICA_GROUP_ID": str(group),
            "NUM_REPLICA_GROUPS": str(replicas),
            MARKER_ENV: marker,
        }
    )
    return env


def common_env(base: Mapping[str, str], nproc: int) -> dict[str, str]:
    """What every rank's environment holds whatever its group and rank (a warm spare's)."""
    env = {**base, "PYTHONUNBUFFERED": "1"}
    # torchrun does the same: K ranks each using every core would oversubscribe the machine.
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class GroupStart:
    """Starts one incarnation (1, 2, ...) of a replica group: its store, then its K ranks.

    Each rank's output is read by a thread of its own and put on ``lines``. ``spawn`` starts
    one rank from (argv, env) with its output piped (a warm spare pool's); None: ``Popen``.
    """

    def __init__(
        self,
        *,
        group: int,
        incarnation: int,
        command: Sequence[str],
        nproc: int,
        replicas: int,
        lighthouse: str,
        base_env: Mapping[str, str],
        lines: queue.Queue[OutputLine],
        run_id: str,
        host: str = "127.0.0.1",
        spawn: Callable[[list[str], dict[str, str]], subprocess.Popen[str]] | None = None,
    ) -> None:
        self.group = group
        self.incarnation = incarnation
        self.started = time.time()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.exit_codes: dict[int, int] = {}
        # rank -> when its exit was first noticed by polling (its output may still be open).
        self.exit_seen: dict[int, float] = {}
        # Unique per start: another launcher's job of the same name must not match ours.
        self.marker = f"{run_id}/{group}/{incarnation}/{uuid.uuid4().hex}"
        self._store = _host_store(host)
        self.store_address = f"{host}:{self._store.port}"
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for rank in range(nproc):
                env = rank_env(
                    base_env,
                    group=group,
                    replicas=replicas,
                    rank=rank,
                    nproc=nproc,
                    master_addr=host,
                    master_port=self._store.port,
                    lighthouse=lighthouse,
                    restart_count=incarnation - 1,
                    run_id=run_id,
                    marker=self.marker,
                )
                proc = (spawn or _cold)(list(command), env)
                self.procs.append(proc)
                threading.Thread(
                    target=_pump,
                    args=(proc, OutputLine(group, incarnation, rank, None), lines),
                    name=f"launch-pump-{group}-{rank}",
                    daemon=True,
                ).start()
        except BaseException:
            self.kill()
            self.close()
            raise

    def running(self) -> list[int]:
        """Ranks whose process has not exited yet."""
        return [r for r, p in enumerate(self.procs) if p.poll() is None]

    def kill(self) -> None:
        """SIGKILLs every rank and everything they started (see ``proctree``)."""
        # Exited ranks are reaped (their pids may be reused): the marker finds their children.
        kill_trees([p.pid for p in self.procs if p.poll() is None], (MARKER_ENV, self.marker))

    def reap(self, timeout: float = 30.0) -> None:
        """Waits for every rank to exit and records its exit code."""
        for rank, proc in enumerate(self.procs):
            try:
                self.exit_codes[rank] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_trees([proc.pid], (MARKER_ENV, self.marker))
                self.exit_codes[rank] = proc.wait(timeout=timeout)

    def close(self) -> None:
        """Stops the group's store (after its ranks are gone)."""
        self._store = None


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``signal SIGKILL`` for a process's return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _cold(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        errors="replace",
    )


def _pump(proc: subprocess.Popen[str], end: OutputLine, lines: queue.Queue[OutputLine]) -> None:
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.put(OutputLine(end.group, end.incarnation, end.rank, line.rstrip("\n")))
    except (OSError, ValueError):
        pass  # the pipe broke as the process died
    lines.put(end)


def _host_store(host: str) -> Any:
    # Imported here: only starting a group needs torch (the CLI's --help does not).
    import torch.distributed as dist

    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
