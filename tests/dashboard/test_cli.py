"""``torchheal lighthouse`` serves the dashboard; ``torchheal status`` reads it (real processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest

from tests.dashboard.helpers import http, scrape
from torchheal.coordination import LighthouseClient
from torchheal.coordination.lighthouse.dashboard.events import MemberInfo, QuorumIssued
from torchheal.coordination.lighthouse.dashboard.history import History
from torchheal.coordination.lighthouse.dashboard.terminal import render
from torchheal.coordination.lighthouse.dashboard.view import build_status

A = "a:0b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"


def torchheal(*args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torchheal.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        **kw,  # type: ignore[arg-type]
    )


@contextmanager
def lighthouse(*extra: str, env: dict[str, str] | None = None) -> Iterator[tuple[int, str]]:
    """``torchheal lighthouse`` on loopback; yields (gRPC port, dashboard URL)."""
    proc = torchheal("lighthouse", "--min_replicas", "1", "--bind", "127.0.0.1:0", *extra, env=env)
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
        grpc_port = re.search(r"serving on http://.+:(\d+)$", first.strip())
        dashboard = re.fullmatch(r"dashboard: (http://127\.0\.0\.1:\d+/)", second.strip())
        assert grpc_port and dashboard, (first, second, proc.stderr.read() if proc.poll() else "")
        yield int(grpc_port.group(1)), dashboard.group(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchheal.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_lighthouse_prints_its_dashboard_and_status_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with lighthouse("--dashboard-port", "0", env={"TORCHHEAL_TOKEN": "s3cret"}) as (port, url):
        # The job token guards the lighthouse's gRPC too: this client is one of the job's.
        monkeypatch.setenv("TORCHHEAL_TOKEN", "s3cret")
        client = LighthouseClient(f"127.0.0.1:{port}", timedelta(seconds=10))
        client.quorum(A, timeout=timedelta(seconds=10), step=42, address="http://127.0.0.1:1")
        client.close()
        assert scrape(url)["torchheal_lighthouse_quorum_rounds_total"] == 1

        # The token comes from the environment: a kill without it is refused.
        code, _, body = http(url + "api/replicas/a/kill", method="POST")
        assert code == 401 and b"job token" in body

        shown = status(url)
        assert shown.returncode == 0, shown.stderr
        assert "quorum #1" in shown.stdout and "job step 42" in shown.stdout
        member = next(line for line in shown.stdout.splitlines() if line.startswith("a "))
        assert member.split()[:4] == ["a", "0b5f0a4e", "training", "42"]

        as_json = status(url.removeprefix("http://").rstrip("/"), "--json")
        assert json.loads(as_json.stdout)["quorum"]["members"][0]["replica_id"] == A


def test_dashboard_port_comes_from_the_environment_and_is_checked() -> None:
    proc = torchheal(
        "lighthouse", "--min_replicas", "1", "--bind", "127.0.0.1:0",
        env={"TORCHHEAL_DASHBOARD_PORT": "http"},
    )  # fmt: skip
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "TORCHHEAL_DASHBOARD_PORT='http' is not an integer" in err


def test_a_taken_dashboard_port_is_a_clear_start_up_error() -> None:
    # With --bind on port 0, the dashboard too gets a free port instead of 29511.
    with lighthouse() as (_, url):
        taken = url.rstrip("/").rsplit(":", 1)[1]
        assert taken != "29511"
        proc = torchheal(
            "lighthouse", "--min_replicas", "1", "--bind", "127.0.0.1:0", "--dashboard_port", taken
        )
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2
        assert f"dashboard: cannot listen on 127.0.0.1:{taken}" in err
        assert "--dashboard_port" in err


def test_status_without_a_dashboard_says_what_to_check() -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shown = status(f"127.0.0.1:{port}", "--timeout", "5")
    assert shown.returncode == 1
    assert f"cannot reach the lighthouse dashboard at http://127.0.0.1:{port}/api/status" in (
        shown.stderr
    )


def test_terminal_view_fits_one_screen() -> None:
    history = History()
    members = (MemberInfo(A, 10, "http://127.0.0.1:1"), MemberInfo("b", 7, "http://127.0.0.1:2"))
    history.apply(QuorumIssued(1000.0, 3, members, "Fast quorum found!", 0.001))
    lighthouse_status = {
        "quorum_id": 3,
        "reason": "Fast quorum found!",
        "prev_quorum": {
            "quorum_id": 3,
            "age_s": 0.5,
            "max_step": 10,
            "participants": [
                {"replica_id": m.replica_id, "address": m.address, "store_address": "",
                 "step": m.step, "world_size": 1, "shrink_only": False, "commit_failures": 0}
                for m in members
            ],
        },
        "waiting": ["c"],
        "heartbeats": {A: 0.1, "b": 9.0, "c": 0.2, "old": 70.0},
        "config": {"min_replicas": 2, "join_timeout_ms": 100, "quorum_tick_ms": 100,
                   "heartbeat_timeout_ms": 5000},
    }  # fmt: skip
    doc = build_status(lighthouse_status, history.view(1000.5), 1000.5, address="http://lh:29510")
    text = render(doc, width=100)
    lines = text.splitlines()
    assert lines[0].startswith("torchheal lighthouse http://lh:29510  ·  quorum #3 (age 0.5 s)")
    assert lines[2] == "next quorum: Fast quorum found!"
    rows = {line.split()[0]: line.split() for line in lines if line[:2] in ("a ", "b ")}
    assert rows["a"][:5] == ["a", "0b5f0a4e", "training", "10", "0"]
    assert rows["b"][:5] == ["b", "b", "silent", "7", "3"]  # 9 s without a heartbeat
    start = lines.index("outside the quorum:") + 1
    section = lines[start : lines.index("", start)]
    assert {line.split()[0]: line.split()[2] for line in section} == {"c": "waiting", "old": "lost"}
    assert "last quorum changes:" in lines and "  #3  size 2  +a (new replica group" in text
    assert all(len(line) <= 100 for line in lines)
