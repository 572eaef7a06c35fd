"""A throwaway etcd server on loopback for the high-availability tests.

Debian's ``etcd-server`` is installed by ``scripts/setup_env.sh``; a missing ``etcd`` fails the
test loudly (it is never skipped: CI must run it). The server's data lives in a temporary
directory; only the process started here is ever signalled.
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


@contextmanager
def etcd_server(tmp: Path) -> Iterator[str]:
    """Run etcd on two free loopback ports; yields its client URL.

    Args:
        tmp: a directory for its data and log.
    """
    binary = shutil.which("etcd")
    if binary is None:
        pytest.fail("etcd is not installed: run scripts/setup_env.sh (apt-get install etcd-server)")
    client, peer = _free_port(), _free_port()
    url = f"http://127.0.0.1:{client}"
    log = open(tmp / "etcd.log", "w")
    popen = subprocess.Popen(
        [
            binary,
            "--name",
            "test",
            "--data-dir",
            str(tmp / "etcd-data"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"test=http://127.0.0.1:{peer}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + START_BOUND_S
        while True:
            try:
                if requests.get(f"{url}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"etcd did not start (exit {popen.poll()}):\n{(tmp / 'etcd.log').read_text()}"
                )
            time.sleep(0.1)  # polling its health endpoint: nothing to wait on
        yield url
    finally:
        popen.kill()
        popen.wait(timeout=30)
        log.close()
