"""A lighthouse as a real process (``torchheal lighthouse``) that a test can SIGKILL and restart.

Only processes started here are signalled, by their own pid; every wait has a deadline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = re.compile(r"torchheal lighthouse: serving on \S+:(\d+)")
START_BOUND_S = 60.0


class LighthouseProcess:
    """``python -m torchheal.cli.lighthouse`` on loopback; its log goes to ``log``.

    Args:
        log: where its stdout and stderr go (appended across restarts).
        flags: more command-line options (``--state-file``, ``--etcd`` ...).
        port: the port to bind (0: any free one; a restart reuses the first one's).
        wait: wait until it serves (a standby lighthouse only serves once it leads).
    """

    def __init__(self, log: Path, *flags: str, port: int = 0, wait: bool = True) -> None:
        self.log = log
        self.flags = flags
        self.port = port
        self.popen: subprocess.Popen[str] | None = None
        self._serving = threading.Event()
        self.start(wait)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> None:
        """Start it (again, on the same port once it has one) and wait until it serves."""
        assert self.popen is None or self.popen.poll() is not None, "still running"
        cmd = [
            sys.executable,
            "-m",
            "torchheal.cli.lighthouse",
            "--bind",
            f"127.0.0.1:{self.port}",
            "--dashboard_port",
            "0",
            "--min_replicas",
            "1",
            "--join_timeout_ms",
            "100",
            "--heartbeat_timeout_ms",
            "5000",
            *self.flags,
        ]
        with open(self.log, "a") as log:
            log.write(f"\n=== {' '.join(cmd)}\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.popen = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._serving = threading.Event()
        threading.Thread(target=self._copy, args=(self.popen, self._serving), daemon=True).start()
        if wait:
            self.wait_serving(START_BOUND_S)

    def wait_serving(self, timeout_s: float) -> None:
        """Wait until it serves (prints its address)."""
        assert self.popen is not None
        deadline = time.monotonic() + timeout_s
        while not self._serving.wait(0.1):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"lighthouse is not serving (exit {self.popen.poll()}):\n{self.tail()}"
                )

    def wait_log(self, text: str, timeout_s: float = START_BOUND_S) -> None:
        """Wait until its log contains ``text``."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in the lighthouse log:\n{self.tail()}")
            time.sleep(0.1)  # polling a log file another process writes

    def _copy(self, popen: subprocess.Popen[str], found: threading.Event) -> None:
        assert popen.stdout is not None
        with open(self.log, "a") as log:
            for line in popen.stdout:
                log.write(line)
                log.flush()
                match = SERVING.search(line)
                if match and not found.is_set():
                    self.port = int(match.group(1))
                    found.set()

    def kill(self) -> float:
        """SIGKILL it and reap it; returns when (wall clock) the signal was sent."""
        assert self.popen is not None and self.popen.poll() is None, "not running"
        when = time.time()
        self.popen.kill()
        self.popen.wait(timeout=30)
        return when

    def stop(self) -> None:
        """End it if it still runs."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
