"""The local launcher: real child processes, a real SIGKILL, a real restart."""

from __future__ import annotations

import sys
import textwrap
from typing import Any

import pytest

from torchheal.cli.launch import parse_duration
from torchheal.launcher import KillPlan, Launcher
from torchheal.launcher.demo.summary import render, summarize
from torchheal.launcher.events import parse

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from torchheal.launcher.events import emit
    group = int(os.environ["REPLICA_GROUP_ID"])
    assert os.environ["TORCHHEAL_LIGHTHOUSE"] == "http://lighthouse.invalid:1"
    assert os.environ["NUM_REPLICA_GROUPS"] == "2"
    marker = os.path.join(sys.argv[1], f"started-{group}")
    first = not os.path.exists(marker)
    open(marker, "a").close()
    print("plain output line", flush=True)
    if first and group == 1:
        emit("step", group, step=5, committed=True)
        time.sleep(120)  # the launcher must kill us; the test fails on its deadline otherwise
    if group == 1:  # only the victim reports steps, so only its progress can trigger the kill
        open(os.path.join(sys.argv[1], "restarted-1"), "a").close()
        emit("step", group, step=6, committed=True)
    else:
        # Group 0 trains too (a step kill waits for every group to train), and finishes only
        # once the victim is back: a finished job restarts nobody.
        emit("step", group, step=1, committed=True)
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(sys.argv[1], "restarted-1")):
            assert time.time() < deadline
            time.sleep(0.05)
    emit("done", group, step=6, digest="abc")
    """
)


def test_kill_at_step_kills_the_victim_and_restarts_it(tmp_path):
    events, output, kills = [], [], []
    launcher = Launcher(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        replicas=2,
        lighthouse_addr="http://lighthouse.invalid:1",
        kill_plan=KillPlan(at_step=5, victims=(1,), max_kills=1),
        restart_delay_s=0.1,
        deadline_s=60,
        on_event=events.append,
        on_output=lambda g, line: output.append((g, line)),
        on_kill=lambda g, reason: kills.append(g),
    )
    result = launcher.run()
    assert not result.timed_out
    assert kills == [1]
    assert len(result.groups[1].starts) == 2 and len(result.groups[0].starts) == 1
    assert result.groups[1].exit_codes == [-9, 0]
    assert result.groups[0].exit_codes == [0]
    assert (0, "plain output line") in output and (1, "plain output line") in output
    assert sorted(e.group for e in events if e.kind == "done") == [0, 1]

    summary = summarize(result)
    assert summary.failures == 1
    assert summary.identical
    assert summary.steps_committed == 6
    assert summary.recoveries[0].group == 1 and summary.recoveries[0].rejoin_s is not None


def test_deadline_ends_every_child(tmp_path):
    launcher = Launcher(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        replicas=2,
        lighthouse_addr="http://x:1",
        deadline_s=1.0,
    )
    result = launcher.run()
    assert result.timed_out
    for g in result.groups.values():
        assert g.proc is not None and g.proc.poll() is not None


def test_event_parsing_ignores_malformed_lines():
    assert parse("hello") is None
    assert parse("@torchheal not json") is None
    assert parse('@torchheal {"kind": "step"}') is None  # no group or time
    assert parse('@torchheal {"kind": 3, "group": 0, "time": 1}') is None
    e = parse('@torchheal {"kind": "step", "group": "1", "time": 2.5, "step": 3}')
    assert e is not None and e.group == 1 and e.time == 2.5 and e.fields == {"step": 3}


def test_launcher_rejects_bad_arguments():
    with pytest.raises(ValueError, match="replicas"):
        Launcher(["x"], replicas=0, lighthouse_addr="http://x:1")
    with pytest.raises(ValueError, match="command"):
        Launcher([], replicas=1, lighthouse_addr="http://x:1")


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30.0), ("1.5m", 90.0), ("500ms", 0.5), ("2", 2.0), ("1h", 3600.0)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "-1s", "0s", "5 parsecs"])
def test_parse_duration_rejects(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def _finished(digests: dict[int, str], groups: int = 2) -> Any:
    from torchheal.launcher.events import Event
    from torchheal.launcher.records import GroupProcess, RunResult

    events = [Event("done", g, 1.0, {"step": 6, "digest": d}) for g, d in digests.items()]
    return RunResult(events, {g: GroupProcess(g) for g in range(groups)}, 0.0, 1.0, False)


def test_identical_weights_verdict_follows_the_digests() -> None:
    same = summarize(_finished({0: "a" * 64, 1: "a" * 64}))
    assert same.identical
    assert "identical weights      yes, bit-identical on every group" in render(same)
    differ = summarize(_finished({0: "a" * 64, 1: "b" * 64}))
    assert not differ.identical
    text = render(differ)
    assert "identical weights      NO" in text
    assert "group 0: sha256 aaaaaaaaaaaaaaaa" in text and "group 1: sha256 bbbbbbbbbbbbbbbb" in text
    # A group that never reported its weights cannot be called identical either.
    assert not summarize(_finished({0: "a" * 64}, groups=2)).identical


def test_each_recovery_says_whether_its_restart_began_in_a_warm_spare() -> None:
    from torchheal.launcher.events import Event
    from torchheal.launcher.records import GroupProcess, RunResult

    # Group 1 is killed twice: its first restart (t=3) started cold (the spare was not ready),
    # its second (t=8) began in a warm spare. Only a start's own event marks its recovery warm.
    victim = GroupProcess(1, starts=[0.0, 3.0, 8.0], kills=[2.0, 7.0])
    events = [
        Event("start", 1, 0.1, {"warm": False}),
        Event("start", 1, 3.1, {"warm": False}),
        Event("step", 1, 3.5, {"committed": True, "healed": True, "step": 9}),
        Event("start", 1, 8.1, {"warm": True}),
        Event("step", 1, 9.0, {"committed": True, "healed": True, "step": 20}),
    ]
    result = RunResult(events, {0: GroupProcess(0), 1: victim}, 0.0, 10.0, False)
    summary = summarize(result)
    assert [(r.warm, r.healed) for r in summary.recoveries] == [(False, True), (True, True)]
    lines = [line for line in render(summary).splitlines() if "killed:" in line]
    assert "; restarted group committed after 0.50s (healed live" in lines[0]
    assert "restarted group (a warm spare) committed after 1.00s (healed live" in lines[1]


def test_demo_commentary_names_real_quorums_only() -> None:
    from torchheal.launcher.demo.run import _Printer
    from torchheal.launcher.events import Event

    said: list[str] = []
    printer = _Printer(said.append, t0=0.0)
    printer.event(Event("quorum", 2, 1.0, {"quorum_id": 4, "participants": 3}))
    # The last step of a group whose peers finished and left: its manager holds no quorum.
    printer.event(Event("quorum", 2, 2.0, {"quorum_id": -1, "participants": 3}))
    assert said == ["[  1.00s] group 2 joined quorum 4 with 3 participating group(s)"]
