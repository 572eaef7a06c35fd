"""The fail-fast job (``tests/failfast/job.py``) with each group in a network namespace.

:class:`NetnsJob` starts the same worker (``tests.failfast.worker``) as the fail-fast tests,
but inside its group's namespace of a :class:`~tests.partition.netns.Network`, with its store
on the group's address; :func:`hub_lighthouse` runs a real ``torchheal lighthouse`` process in
the hub namespace. Everything else (events, waits, finish, replay) is the fail-fast job's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.failfast.job import ROOT, Job, Proc
from tests.partition.netns import HUB_IP, Network

#: The lighthouse's port in the hub namespace (a namespace of this run's own: no clash).
LIGHTHOUSE_PORT = 29510
#: Bound on the lighthouse process's start-up.
LIGHTHOUSE_START_S = 60.0


class NetnsJob(Job):
    """Groups of ``tests.failfast.worker``, each in its namespace of ``network``.

    Args:
        tmp: a directory for logs, the target file and the final states.
        network: the namespaces.
        groups: the job's group count.
        timeout_s: the workers' collective and commit timeout.
    """

    def __init__(self, tmp: Path, network: Network, groups: int, *, timeout_s: float) -> None:
        super().__init__(tmp, f"http://{HUB_IP}:{LIGHTHOUSE_PORT}", groups, timeout_s=timeout_s)
        self.network = network

    def start(self, group: int, *flags: str) -> Proc:
        """Starts the next incarnation of ``group`` in its namespace (``flags``: worker options)."""
        incarnation = len(self.procs.get(group, []))
        log = self.tmp / f"g{group}i{incarnation}.log"
        out = self.tmp / f"g{group}i{incarnation}.pt"
        worker = [
            sys.executable, "-m", "tests.failfast.worker",
            "--group", str(group),
            "--incarnation", str(incarnation),
            "--groups", str(self.groups),
            "--lighthouse", self.lighthouse,
            "--target-file", str(self.target_file),
            "--out", str(out),
            "--timeout", str(self.timeout_s),
            "--host", self.network.ip(group),
            *flags,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(log, "w") as err:
            # ``ip netns exec``, ``unshare`` and ``sh`` all exec: the pid is the worker's own.
            popen = subprocess.Popen(
                self.network.command(group, worker),
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        proc = Proc(group, incarnation, popen, log, out, time.time())
        proc.reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        proc.reader.start()
        self.procs.setdefault(group, []).append(proc)
        return proc


@contextmanager
def hub_lighthouse(network: Network, log: Path, heartbeat_timeout_ms: int) -> Iterator[Path]:
    """A ``torchheal lighthouse`` process in the hub namespace; yields its log's path.

    The reference's defaults otherwise: ``min_replicas=1``, join timeout 100 ms, tick 100 ms.

    Args:
        network: the namespaces.
        log: where its stderr (every issued quorum) goes.
        heartbeat_timeout_ms: how long a silent group stays in the quorum.
    """
    argv = [
        sys.executable, "-m", "torchheal.cli", "lighthouse",
        "--min_replicas", "1",
        "--join_timeout_ms", "100",
        "--quorum_tick_ms", "100",
        "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
        "--bind", f"{HUB_IP}:{LIGHTHOUSE_PORT}",
        "--dashboard_port", "0",
    ]  # fmt: skip
    with open(log, "w") as err:
        popen = subprocess.Popen(
            network.command(None, argv),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        serving = threading.Event()

        def read() -> None:
            assert popen.stdout is not None
            for line in popen.stdout:
                if line.startswith("torchheal lighthouse: serving on"):
                    serving.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + LIGHTHOUSE_START_S
        while not serving.wait(0.1):
            assert popen.poll() is None, f"the lighthouse exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the lighthouse did not start in time"
        yield log
    finally:
        if popen.poll() is None:
            popen.kill()
        popen.wait(timeout=30)
        if popen.stdout is not None:
            popen.stdout.close()
