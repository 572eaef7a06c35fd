"""The dashboard and ``torchheal status`` show each group's divergence-guard report (issue 41).

Groups send their guard's counts in their quorum requests' ``data``; the history keeps each
group's last report and marks where a group's mismatch count rose (the red marks of the page's
timeline); ``torchheal status`` prints the last verified step per group.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial

from tests.cluster import run_parallel
from tests.dashboard.helpers import get_json, wait_until
from tests.dashboard.test_cli import lighthouse, status
from torchheal.coordination import LighthouseClient
from torchheal.coordination.guard_report import GuardReport
from torchheal.coordination.lighthouse.dashboard import LighthouseRecorder
from torchheal.coordination.lighthouse.dashboard.events import MemberInfo, QuorumIssued
from torchheal.coordination.lighthouse.dashboard.history import History, HistoryLimits
from torchheal.coordination.lighthouse.dashboard.terminal import render
from torchheal.coordination.lighthouse.dashboard.view import build_status
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

A = "a:0b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"
B = "b:1b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"
B2 = "b:2b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"  # b restarted
REF = "ref:3b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"  # a reference group: no report


def issued(t: float, qid: int, *members: tuple[str, int, GuardReport | None]) -> QuorumIssued:
    infos = tuple(MemberInfo(rid, step, guard=report) for rid, step, report in members)
    return QuorumIssued(t, qid, infos, "Fast quorum found!", 0.01)


def test_history_keeps_each_groups_report_and_marks_each_rise() -> None:
    history = History(HistoryLimits(divergences=3))
    history.apply(issued(1.0, 1, (A, 0, None), (B, 0, None), (REF, 0, None)))
    history.apply(issued(2.0, 1, (A, 1, GuardReport(-1, 0, 0)), (B, 1, GuardReport(-1, 0, 0))))
    assert history.view(2.5)["divergences"] == []
    # Step 1 differed: both groups count it, b falls behind.
    history.apply(issued(3.0, 1, (A, 3, GuardReport(-1, 1, 1)), (B, 2, GuardReport(-1, 1, 1))))
    history.apply(issued(4.0, 1, (A, 4, GuardReport(-1, 1, 1)), (B, 4, GuardReport(-1, 1, 1))))
    view = history.view(4.5)
    assert [(d["t"], d["group"], d["step"], d["new"]) for d in view["divergences"]] == [
        (3.0, "b", 2, 1),
        (3.0, "a", 3, 1),
    ]  # newest first; the unchanged count at t=4 marks nothing
    # b restarts: its new process counts from zero, so a count of 1 there is a new rise,
    # and a quorum without b's report keeps its last one.
    history.apply(issued(5.0, 2, (A, 5, GuardReport(4, 2, 1)), (B2, 5, GuardReport(-1, 1, 1))))
    history.apply(issued(6.0, 2, (A, 6, GuardReport(5, 3, 1)), (B2, 6, None)))
    view = history.view(6.5)
    assert [(d["group"], d["replica_id"], d["step"]) for d in view["divergences"]] == [
        ("b", B2, 5),
        ("b", B, 2),
        ("a", A, 3),
    ]
    assert view["guard"]["a"] == {
        "replica_id": A, "verified": 5, "checks": 3, "mismatches": 1, "t": 6.0
    }  # fmt: skip
    assert view["guard"]["b"]["replica_id"] == B2 and view["guard"]["b"]["verified"] == -1
    assert "ref" not in view["guard"]
    history.apply(issued(7.0, 2, (A, 7, GuardReport(6, 4, 2)), (B2, 7, None)))
    assert len(history.view(7.5)["divergences"]) == 3  # bounded: the oldest went


def test_the_recorder_reads_reports_and_ignores_other_data() -> None:
    recorder = LighthouseRecorder(clock_offset=0.0)
    members = (
        QuorumMember(A, step=3, data={"verified": 2, "checks": 1, "mismatches": 0}),
        QuorumMember(B, step=3, data={"verified": "2", "checks": 1, "mismatches": 0}),
        QuorumMember(REF, step=3, data={"anything": ["a user's"]}),
    )
    recorder.quorum_issued(Quorum(1, members, Timestamp(0, 0)), "Fast quorum found!", 0.1, 1.0)
    (event,) = recorder.drain()
    assert [m.guard for m in event.members] == [GuardReport(2, 1, 0), None, None]


def _lighthouse_status(members: list[tuple[str, int]]) -> dict:
    return {
        "quorum_id": 2,
        "reason": "Fast quorum found!",
        "prev_quorum": {
            "quorum_id": 2,
            "age_s": 0.5,
            "max_step": max(step for _, step in members),
            "participants": [
                {"replica_id": rid, "address": "http://h:1", "store_address": "", "step": step,
                 "world_size": 1, "shrink_only": False, "commit_failures": 0}
                for rid, step in members
            ],
        },
        "waiting": [],
        "heartbeats": {rid: 0.1 for rid, _ in members},
        "config": {"min_replicas": 1, "join_timeout_ms": 100, "quorum_tick_ms": 100,
                   "heartbeat_timeout_ms": 5000},
    }  # fmt: skip


def test_terminal_prints_verified_steps_and_mismatches() -> None:
    history = History()
    history.apply(issued(10.0, 2, (A, 8, GuardReport(6, 3, 0)), (B, 8, GuardReport(-1, 1, 1))))
    history.apply(issued(11.0, 2, (A, 9, GuardReport(6, 3, 0)), (B, 9, GuardReport(-1, 1, 1))))
    doc = build_status(_lighthouse_status([(A, 9), (B, 9)]), history.view(11.5), 11.5)
    assert {m["group"]: (m["verified"], m["mismatches"]) for m in doc["quorum"]["members"]} == {
        "a": (6, 0),
        "b": (-1, 1),
    }
    lines = render(doc).splitlines()
    start = lines.index("divergence guard:") + 1
    rows = {line.split()[0]: line for line in lines[start : start + 2]}
    assert "verified step 6" in rows["a"] and "mismatch" not in rows["a"]
    assert "not verified yet" in rows["b"] and "1 mismatch, last at step 8" in rows["b"]
    # No group reports (reference groups, the guard off, an older lighthouse): no section.
    bare = build_status(_lighthouse_status([(REF, 9)]), History().view(11.5), 11.5)
    assert "divergence guard:" not in render(bare)
    del bare["guard"], bare["divergences"]
    assert "divergence guard:" not in render(bare)


def test_torchheal_status_prints_each_groups_verified_step() -> None:
    # A real lighthouse process; two clients ask for quorums with guard reports in their data,
    # as group rank 0's manager server does, and one with a user's data.
    with lighthouse("--dashboard-port", "0", "--min_replicas", "3") as (port, url):
        reports = {
            A: {"verified": 120, "checks": 3, "mismatches": 0},
            B: {"verified": -1, "checks": 2, "mismatches": 2},
            REF: {"loss": 0.5},
        }
        clients = [LighthouseClient(f"127.0.0.1:{port}", timedelta(seconds=10)) for _ in reports]

        def ask(client: LighthouseClient, rid: str) -> None:
            client.quorum(rid, timeout=timedelta(seconds=10), step=130, data=reports[rid])

        # Together, in one quorum of the three (min_replicas 3).
        run_parallel(*(partial(ask, c, rid) for c, rid in zip(clients, reports, strict=True)))
        for client in clients:
            client.close()
        wait_until(lambda: len(get_json(url + "api/status")["guard"]) == 2, what="reports")
        shown = status(url)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        start = lines.index("divergence guard:") + 1
        rows = {line.split()[0]: line for line in lines[start : start + 3] if line.strip()}
        assert set(rows) == {"a", "b"}
        assert "verified step 120" in rows["a"] and "mismatch" not in rows["a"]
        assert "not verified yet" in rows["b"] and "2 mismatches, last at step 130" in rows["b"]
