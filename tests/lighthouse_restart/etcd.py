"""A throwaway etcd server on loopback for the high-availability tests.

Debian's ``etcd-server`` is installed by ``scripts/setup_env.sh``; a missing ``etcd`` fails the
test loudly (it is never skipped: CI must run it). The server's data lives in a temporary
directory; only the process started here is ever signalled. :class:`Etcd` can be stopped and
started again on the same ports and data (an outage, as clients see one).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

START_BOUND_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """One etcd member on two free loopback ports, its data and log in ``tmp``.

    Args:
        tmp: a directory for its data and log.
    """

    def __init__(self, tmp: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail(
                "etcd is not installed: run scripts/setup_env.sh (apt-get install etcd-server)"
            )
        self._tmp = tmp
        client, peer = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{client}"
        self._argv = [
            binary,
            "--name",
            "test",
            "--data-dir",
            str(tmp / "etcd-data"),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{peer}",
        ]
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (again, with the data it had) and wait until it answers."""
        with open(self._tmp / "etcd.log", "a") as log:
            self._popen = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_BOUND_S
        while True:
            try:
                if requests.get(f"{self.url}/health", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            if self._popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"etcd did not start (exit {self._popen.poll()}):\n"
                    f"{(self._tmp / 'etcd.log').read_text()}"
                )
            time.sleep(0.1)  # polling its health endpoint: nothing to wait on

    def stop(self) -> None:
        """SIGKILL it, as a crash would, and reap it."""
        if self._popen is not None:
            self._popen.kill()
            self._popen.wait(timeout=30)
            self._popen = None


@contextmanager
def etcd_process(tmp: Path) -> Iterator[Etcd]:
    """Run etcd (see :class:`Etcd`); yields it, started.

    Args:
        tmp: a directory for its data and log.
    """
    etcd = Etcd(tmp)
    try:
        etcd.start()
        yield etcd
    finally:
        etcd.stop()


@contextmanager
def etcd_server(tmp: Path) -> Iterator[str]:
    """Run etcd on two free loopback ports; yields its client URL.

    Args:
        tmp: a directory for its data and log.
    """
    with etcd_process(tmp) as etcd:
        yield etcd.url
