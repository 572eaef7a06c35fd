"""``torchheal lighthouse`` as a real subprocess, and the dispatcher's argument handling."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from torchheal import cli
from torchheal.coordination import LighthouseClient


def start_lighthouse(*extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "torchheal.cli", "lighthouse", "--bind", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def served_port(proc: subprocess.Popen[str]) -> int:
    line = proc.stdout.readline()
    match = re.search(r"serving on http://.+:(\d+)$", line.strip())
    assert match, f"unexpected first line {line!r}; stderr: {proc.stderr.read()}"
    return int(match.group(1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_lighthouse_serves_logs_and_exits_cleanly_on_signal(sig):
    proc = start_lighthouse("--min-replicas", "1", "--join_timeout_ms", "100")
    try:
        port = served_port(proc)
        client = LighthouseClient(f"127.0.0.1:{port}", connect_timeout=timedelta(seconds=10))
        quorum = client.quorum(replica_id="cli-replica", timeout=timedelta(seconds=10))
        assert quorum.quorum_id == 1
        client.close()
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        stderr = proc.stderr.read()
        assert "Issued quorum 1 with 1 participants: ['cli-replica']" in stderr
        assert "Quorum status: Valid quorum found" in stderr
        assert "shutting down" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bind_failure_exits_with_code_2():
    first = start_lighthouse("--min_replicas", "1")
    try:
        port = served_port(first)
        second = start_lighthouse("--min_replicas", "1", "--bind", f"127.0.0.1:{port}")
        assert second.wait(timeout=20) == 2
        assert "bind" in second.stderr.read()
        second.stdout.close()
        second.stderr.close()
    finally:
        first.terminate()
        assert first.wait(timeout=20) == 0


def test_help_lists_flags_and_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["lighthouse", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag, default in [
        ("--join_timeout_ms", "60000"),
        ("--quorum_tick_ms", "100"),
        ("--heartbeat_timeout_ms", "5000"),
        ("--bind", "[::]:29510"),
    ]:
        assert flag in out
        assert f"default: {default}" in out
    assert "--min_replicas" in out and "--min-replicas" in out


def test_min_replicas_is_required(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["lighthouse"])
    assert info.value.code == 2
    assert "--min_replicas" in capsys.readouterr().err


def test_parser_reads_both_spellings():
    from torchheal.cli import lighthouse as cli_lighthouse

    parser = cli_lighthouse.build_parser(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--min-replicas", "3", "--quorum-tick-ms", "7"])
    assert (args.min_replicas, args.quorum_tick_ms, args.join_timeout_ms) == (3, 7, 60000)
    args = parser.parse_args(["--min_replicas", "2", "--heartbeat_timeout_ms", "9"])
    assert (args.min_replicas, args.heartbeat_timeout_ms, args.bind) == (2, 9, "[::]:29510")


def test_top_level_help_and_unknown_command(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "lighthouse" in capsys.readouterr().out
    assert cli.main([]) == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["no-such-command"])
    assert info.value.code == 2
