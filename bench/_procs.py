"""Lighthouse processes for the multi-process benchmarks (standard library only: the benchmarks'
workers import this before they time their own start-up)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A loopback port the OS had free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse_command(impl: str, port: int, join_timeout_ms: int = 100) -> list[str]:
    """The lighthouse CLI of ``impl`` on ``port`` at the reference's defaults.

    The torchheal one's dashboard takes any free port: 29511 may be held by another lighthouse.
    """
    if impl == "torchft":
        cmd = [str(BIN / "torchft_lighthouse")]
    else:
        cmd = [str(BIN / "torchheal"), "lighthouse", "--dashboard_port", "0"]
    cmd += ["--bind", f"127.0.0.1:{port}", "--min_replicas", "1"]
    cmd += ["--join_timeout_ms", str(join_timeout_ms), "--quorum_tick_ms", "100"]
    return [*cmd, "--heartbeat_timeout_ms", "5000"]


@contextmanager
def lighthouse_process(
    cmd: list[str],
    port: int,
    stdout: IO[Any] | int = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    start_s: float = 30.0,
) -> Iterator[str]:
    """Runs ``cmd`` (a lighthouse serving on ``port``) in its own process; yields its address.

    Args:
        cmd: the command line.
        port: the port it serves on (waited for until ``start_s``).
        stdout: where its output goes (stderr too).
        env: its environment (this process's when None).
        start_s: how long it may take to come up.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=Path(__file__).resolve().parent.parent,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.time() + start_s
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"lighthouse {cmd} did not come up")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
