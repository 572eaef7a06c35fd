"""``torchheal launch`` as a user runs it: the example script, groups of two ranks, a real
lighthouse, its dashboard, the progress line and the report; and a crash loop that stops."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHHEAL = [sys.executable, "-m", "torchheal.cli"]


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 240):
    return subprocess.run(
        [*TORCHHEAL, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.slow
def test_launch_runs_the_ddp_example_as_groups_of_two_ranks() -> None:
    # Before groups got torchrun's variables, every group died at start-up with
    # KeyError: 'MASTER_ADDR' and was restarted forever.
    done = _run(
        [
            "launch",
            "--replicas",
            "2",
            "--nproc-per-replica",
            "2",
            "--dashboard-port",
            "0",
            "--deadline",
            "200s",
            "--",
            sys.executable,
            "examples/train_ddp.py",
        ],
        env={"STEPS": "20", "OMP_NUM_THREADS": "1"},
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-3000:]
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/$", out, re.M), out[:2000]
    for group in (0, 1):
        for rank in (0, 1):
            assert f"[group {group}] [rank {rank}] step 20 loss" in out, out[-4000:]
    assert "KeyError" not in out
    assert "== torchheal launch summary ==" in out
    assert re.search(r"^job step               (19|20) \(at the last quorum\)$", out, re.M), out[
        -2000:
    ]
    # Groups that finished and fell silent are not failures.
    assert "failures seen          0 (by the lighthouse)" in out, out[-2000:]
    assert "group 0: started 1x, killed 0x, crashed 0x, finished" in out
    assert "group 1: started 1x, killed 0x, crashed 0x, finished" in out


def test_launch_stops_a_crash_loop_and_names_the_cause() -> None:
    done = _run(
        [
            "launch",
            "--replicas",
            "2",
            "--restart-delay",
            "100ms",
            "--dashboard-port",
            "0",
            "--max-startup-failures",
            "2",
            "--",
            sys.executable,
            "-c",
            "import os; os.environ['TRAIN_DATA_DIR']",
        ],
        timeout=120,
    )
    assert done.returncode == 1, done.stdout[-3000:]
    assert "died 2 times in a row before its first step (last: exit code 1)" in done.stderr
    assert "KeyError: 'TRAIN_DATA_DIR'" in done.stderr
    assert "gave up" in done.stdout


def test_launch_needs_a_command() -> None:
    done = _run(["launch", "--replicas", "2"], timeout=60)
    assert done.returncode == 2
    assert "give the training command after --" in done.stderr


def test_launch_with_a_lighthouse_of_its_own_reads_its_dashboard() -> None:
    from torchheal.launcher.lighthouse import LocalLighthouse

    lh = LocalLighthouse(dashboard_port=0)
    try:
        ok = f"import os; assert os.environ['TORCHHEAL_LIGHTHOUSE'] == {lh.address!r}"
        done = _run(
            ["launch", "--replicas", "1", "--lighthouse", lh.address,
             "--lighthouse-dashboard", lh.dashboard_url, "--", sys.executable, "-c", ok],
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"[launch] dashboard: {lh.dashboard_url}" in done.stdout
        # No dashboard there (a port the OS just handed out, closed): said once, and the
        # launch still runs.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            nobody = f"127.0.0.1:{sock.getsockname()[1]}"
        silent = _run(
            ["launch", "--replicas", "1", "--lighthouse", lh.address,
             "--lighthouse-dashboard", nobody, "--", sys.executable, "-c", ok],
            timeout=120,
        )  # fmt: skip
        assert silent.returncode == 0, silent.stdout + silent.stderr
        assert f"no lighthouse dashboard answers at http://{nobody}" in silent.stdout
    finally:
        lh.shutdown()
