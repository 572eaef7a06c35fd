"""One start of one replica group: a torchrun-like job of K ranks on this machine.

Each start (an *incarnation*) gets what torchrun's agent would give it: a fresh TCPStore hosted
here (``TORCHELASTIC_USE_AGENT_STORE=True``) and torchrun's per-rank variables, plus
``TORCHHEAL_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS``. The store is fresh so
a restarted group never finds the previous start's keys. The ranks' output is read by one
thread per rank and queued to the launcher, tagged with group, incarnation and rank.
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
    """One line a rank printed, or the end of its output (``text`` None: it is exiting).

    Args:
        group: replica group index.
        incarnation: which start of the group (1 for the first).
        rank: the rank in its group.
        text: the line without its newline, or None at the end of the output.
    """

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
    """The environment of one rank, as torchrun would set it, plus torchheal's variables.

    Args:
        base: the environment to start from (the launcher's, plus the user's extras).
        group: the replica group index (``REPLICA_GROUP_ID``).
        replicas: how many groups the job has (``NUM_REPLICA_GROUPS``).
        rank: the rank in its group (``RANK`` and ``LOCAL_RANK``: one node per group).
        nproc: ranks per group (``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``).
        master_addr: the host of the group's TCPStore.
        master_port: its port.
        lighthouse: the lighthouse address.
        restart_count: how many times this group was restarted before this start.
        run_id: names the job (``TORCHELASTIC_RUN_ID``).
        marker: the value of :data:`MARKER_ENV`, which tells this start's processes apart.
    """
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
    """What every rank's environment holds whatever its group and rank (a warm spare's).

    Args:
        base: the environment to start from.
        nproc: ranks per group.
    """
    env = {**base, "PYTHONUNBUFFERED": "1"}
    # torchrun does the same: K ranks each using every core would oversubscribe the machine.
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class GroupStart:
    """Starts one incarnation of a replica group: its store, then its K ranks.

    Args:
        group: the replica group index.
        incarnation: 1 for the first start, then 2, 3, ...
        command: argv of every rank.
        nproc: ranks in the group.
        replicas: groups in the job.
        lighthouse: the lighthouse address.
        base_env: the environment every rank starts from.
        lines: where output lines go.
        run_id: the job's name.
        host: the address the ranks reach the store at.
        spawn: starts one rank from (argv, env) with its output piped (a warm spare pool's
            ``spawn``); None: an ordinary process.
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
        # Unique to this start, not only to the job's name: a second launcher on this machine
        # whose job has the same name must not find its processes in ours when we end them.
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

    @property
    def port(self) -> int:
        """The port of this incarnation's TCPStore (``MASTER_PORT``)."""
        return int(self._store.port)

    def running(self) -> list[int]:
        """Ranks whose process has not exited yet."""
        return [r for r, p in enumerate(self.procs) if p.poll() is None]

    def kill(self) -> None:
        """SIGKILLs every rank and everything they started (see ``proctree``)."""
        # Exited ranks are reaped already (their pids may name others now): only the live
        # ones are roots; what the dead ones started is found by the marker.
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
        self._store = _Closed(self._store.port)


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``signal SIGKILL`` for a process's return code.

    Args:
        code: the return code (negative: the signal that ended it).
    """
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


class _Closed:
    """What is left of a store after :meth:`GroupStart.close`: its port, for messages."""

    def __init__(self, port: int) -> None:
        self.port = port
