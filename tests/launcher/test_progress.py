"""The launcher's reading of the lighthouse status: first steps, progress line, report."""

from __future__ import annotations

import io

from torchheal.launcher.progress import (
    FirstSteps,
    GroupReport,
    LiveLine,
    progress_line,
    quorum_members,
    render_report,
)


def _doc(members: list[tuple[str, int]], **extra) -> dict:
    return {
        "quorum": {
            "id": 4,
            "size": len(members),
            "members": [{"store_address": a, "step": s} for a, s in members],
        },
        "job": {"step": max((s for _, s in members), default=None), "rate": 12.34},
        "failures": [],
        "reason": "",
        **extra,
    }


def test_quorum_members_reads_both_status_shapes() -> None:
    assert quorum_members(_doc([("h:1", 3), ("h:2", 5)])) == [("h:1", 3), ("h:2", 5)]
    lighthouse = {
        "prev_quorum": {"participants": [{"store_address": "h:1", "step": 7}]},
        "quorum_id": 2,
    }
    assert quorum_members(lighthouse) == [("h:1", 7)]
    assert quorum_members({"prev_quorum": None}) == []
    assert quorum_members({"quorum": {"members": [{"store_address": "h:1", "step": "x"}]}}) == []


def test_a_start_has_stepped_once_seen_above_the_step_it_joined_with() -> None:
    first = FirstSteps()
    first.observe([("h:1", 0), ("h:2", 40)])  # h:2 joined late, behind; heals to the job's step
    assert not first.stepped("h:1") and not first.stepped("h:2")
    first.observe([("h:1", 0), ("h:2", 40)])  # a failed step: same steps again
    assert not first.stepped("h:1")
    first.observe([("h:1", 1), ("h:2", 41)])
    assert first.stepped("h:1") and first.stepped("h:2")
    first.forget("h:1")
    assert not first.stepped("h:1")
    first.observe([("h:1", 1)])  # a new start reusing the address begins from scratch
    assert not first.stepped("h:1")


def test_progress_line() -> None:
    line = progress_line(_doc([("h:1", 9), ("h:2", 10)]), 12.5, groups=3, restarts=2)
    assert line == (
        "[launch   12.5s] step 10  12.3 steps/s  quorum 4: 2/3 groups  failures 0 (healed 0)  "
        "restarts 2"
    )
    assert "waiting for the lighthouse" in progress_line(None, 1.0, groups=2, restarts=0)
    waiting = {"quorum": {"id": 0, "members": []}, "job": {"step": None}, "reason": "need 2"}
    assert "waiting for the first quorum (need 2)" in progress_line(waiting, 1, 2, 0)


def test_report_lists_failures_oldest_first_and_drops_the_end_of_the_job() -> None:
    failures = [  # newest first, as the status document lists them
        {
            "group": "g1",
            "cause": "heartbeat expired",
            "state": "noticed",
            "last_in_quorum": 100.0,
            "noticed": 102.0,
            "went_on": None,
            "healed": None,
            "lost_s": None,
        },
        {
            "group": "g2",
            "cause": "killed from dashboard",
            "state": "healed",
            "last_in_quorum": 50.0,
            "noticed": 50.5,
            "went_on": 51.5,
            "healed": 55.0,
            "lost_s": 1.25,
        },
    ]
    doc = _doc([("h:1", 99)], failures=failures)
    groups = [GroupReport(0, 1, 0, 0, True), GroupReport(1, 3, 1, 1, True)]
    text = render_report(doc, groups, 60.0, None, finished=True)
    assert "job step               99 (at the last quorum)" in text
    assert "failures seen          1 (by the lighthouse)" in text
    assert (
        "  g2 (killed from dashboard): survivors went on after 1.50s; group back and healed "
        "3.50s later; job time lost 1.25s"
    ) in text
    assert "seconds lost           1.25s" in text
    assert "  group 1: started 3x, killed 1x, crashed 1x, finished" in text
    # A run that did not finish keeps the silent group as a failure, and says why it stopped.
    text = render_report(doc, groups, 60.0, "group 1 died 3 times\nmore", finished=False)
    assert "failures seen          2" in text and "g1 (heartbeat expired): now noticed" in text
    assert "gave up                group 1 died 3 times" in text
    assert "job step               n/a" in render_report(None, [], 1.0, None)


def test_a_group_that_finished_before_a_late_starter_is_not_a_failure() -> None:
    # g0 trained alone, finished and said goodbye; g1, started late, went on without it.
    left = {
        "group": "g0",
        "cause": "left: shutdown",
        "state": "down",
        "last_in_quorum": 10.0,
        "noticed": 10.1,
        "went_on": 11.0,
        "returned": None,
        "healed": None,
        "lost_s": 0.9,
    }
    # A group that said goodbye (a crash's clean exit) and came back is a failure all the same.
    back = {**left, "group": "g1", "state": "healed", "returned": 20.0, "healed": 21.0}
    doc = _doc([("h:1", 20)], failures=[back, left])
    groups = [GroupReport(0, 1, 0, 0, True), GroupReport(1, 2, 0, 1, True)]
    text = render_report(doc, groups, 30.0, None, finished=True)
    assert "failures seen          1 (by the lighthouse)" in text
    assert "g1 (left: shutdown)" in text and "g0 (left: shutdown)" not in text
    assert "seconds lost           0.90s" in text
    # A job that did not finish keeps it: the group may have left for good mid-run.
    unfinished = render_report(doc, groups, 30.0, "gave up", finished=False)
    assert "failures seen          2" in unfinished


def test_live_line_on_a_pipe_prints_progress_at_intervals() -> None:
    now = [0.0]
    out = io.StringIO()
    live = LiveLine(out, every_s=10.0, clock=lambda: now[0])
    live.status("p1")
    live.print("a")
    now[0] = 5.0
    live.status("p2")  # too soon: not printed
    now[0] = 10.0
    live.status("p3")
    live.close()
    assert out.getvalue() == "p1\na\np3\n"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_line_on_a_terminal_keeps_progress_below_the_output() -> None:
    out = _Tty()
    live = LiveLine(out)
    live.status("p1")
    live.print("a")
    live.status("p2")
    live.close()
    assert out.getvalue() == "\r\033[Kp1\r\033[Ka\np1\r\033[Kp2\n"
