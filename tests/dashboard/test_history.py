"""The pure dashboard history: quorum history, recovery timeline and chart series from events."""

from __future__ import annotations

import pytest

from torchheal.coordination.lighthouse.dashboard.events import (
    Expired,
    Joined,
    KillRequested,
    Lost,
    MemberInfo,
    QuorumIssued,
    ReasonChanged,
    group_name,
)
from torchheal.coordination.lighthouse.dashboard.history import History, HistoryLimits

A = "a:0b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"
B = "b:1b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"
B2 = "b:2b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"  # b restarted
C = "c:3b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"
T0 = 1_000_000.0  # wall-clock seconds; a whole number of buckets


def quorum(t: float, qid: int, reason: str = "Fast quorum found!", **steps: int) -> QuorumIssued:
    """A quorum at ``t`` whose members are given as ``replica_id=step`` (ids via IDS)."""
    members = tuple(
        MemberInfo(IDS[name], step, address=f"http://{name}:1") for name, step in steps.items()
    )
    return QuorumIssued(
        T0 + t, qid, tuple(sorted(members, key=lambda m: m.replica_id)), reason, 0.01
    )


IDS = {"a": A, "b": B, "b2": B2, "c": C}


def steady(
    history: History, start: float, end: float, qid: int, step0: int, names: list[str]
) -> int:
    """One quorum every 0.1 s from ``start`` to ``end`` with every member committing; returns the
    next step."""
    step = step0
    t = start
    while t < end - 1e-9:
        history.apply(quorum(t, qid, **dict.fromkeys(names, step)))
        step += 1
        t = round(t + 0.1, 6)
    return step


def test_group_name_strips_the_per_start_uuid_only() -> None:
    assert group_name(A) == "a"
    assert group_name("train_ddp_0:" + A.split(":")[1]) == "train_ddp_0"
    assert group_name("host:1234") == "host:1234"  # not a uuid: part of the name
    assert group_name("plain") == "plain"
    assert group_name(":" + A.split(":")[1]) == ":" + A.split(":")[1]


def test_steady_job_counts_one_step_per_round_for_the_job_and_each_group() -> None:
    h = History()
    steady(h, 0.0, 12.0, qid=1, step0=0, names=["a", "b", "c"])
    view = h.view(T0 + 12.0)
    assert view["job_step"] == 119
    assert view["job_rate"] == pytest.approx(10.0)  # the last 10 complete buckets
    # Half-way through a bucket the rate is still that of complete buckets (no dip).
    h.apply(quorum(12.0, 1, a=120, b=120, c=120))
    assert h.view(T0 + 12.5)["job_rate"] == pytest.approx(10.0)
    assert {m["group"]: m["rate"] for m in view["members"]} == pytest.approx(
        {"a": 10.0, "b": 10.0, "c": 10.0}
    )
    assert [c["quorum_id"] for c in view["changes"]] == [1]  # no row for unchanged rounds
    assert [j["why"] for j in view["changes"][0]["joined"]] == ["new replica group"] * 3
    assert view["failures"] == []
    series = h.series(T0 + 12.0)
    assert series["t"] == [T0 + i for i in range(12)]
    assert series["job"][1:] == [10.0] * 11  # the first bucket has no previous round to diff
    assert series["groups"]["a"][1:] == [10.0] * 11
    assert series["quorum_size"] == [3] * 12
    # The bucket still filling is not shown: it would dip every chart.
    assert h.series(T0 + 4.5)["t"][-1] == T0 + 3


def test_kill_stall_restart_heal_is_one_recovery_record() -> None:
    h = History()
    step = steady(h, 0.0, 5.0, qid=1, step0=0, names=["a", "b", "c"])  # last round at 4.9
    h.apply(KillRequested(T0 + 5.0, B))
    h.apply(Expired(T0 + 6.0, B, last_seen=T0 + 5.0))  # the kill stays the cause
    h.apply(ReasonChanged(T0 + 6.0, "Valid quorum found [2/2 participants healthy]"))
    h.apply(quorum(6.5, 2, reason="Valid quorum found", a=step, c=step))
    step = steady(h, 6.6, 8.0, qid=2, step0=step + 1, names=["a", "c"])
    h.apply(Joined(T0 + 8.0, B2, step=0))
    h.apply(quorum(8.05, 3, a=step, b2=0, c=step))  # b2 heals from a peer during this step
    h.apply(quorum(8.15, 3, a=step + 1, b2=step + 1, c=step + 1))

    view = h.view(T0 + 9.0)
    (failure,) = view["failures"]
    assert failure["group"] == "b"
    assert failure["replica_id"] == B
    assert failure["cause"] == "killed from dashboard"
    assert failure["state"] == "healed"
    assert failure["last_in_quorum"] == pytest.approx(T0 + 4.9)
    assert failure["noticed"] == pytest.approx(T0 + 5.0)
    assert failure["went_on"] == pytest.approx(T0 + 6.5)
    assert failure["returned"] == pytest.approx(T0 + 8.0)
    assert failure["rejoined"] == pytest.approx(T0 + 8.05)
    assert failure["healed"] == pytest.approx(T0 + 8.15)
    # The stall (4.9 -> 6.5) minus one ordinary step (0.1 s) is what the job lost.
    assert failure["lost_s"] == pytest.approx(1.5)
    assert failure["down_s"] == pytest.approx(3.15)

    left_row, joined_row = view["changes"][1], view["changes"][0]
    assert left_row["quorum_id"] == 2
    assert left_row["left"] == [{"replica_id": B, "group": "b", "why": "killed from dashboard"}]
    assert left_row["reason"] == "Valid quorum found"
    assert joined_row["quorum_id"] == 3
    assert joined_row["joined"] == [
        {"replica_id": B2, "group": "b", "why": f"restarted, healing from step 0 to {step}"}
    ]
    assert view["reason"].startswith("Valid quorum found")

    # Healing's jump from step 0 is not counted as commits: b's line shows one step per round.
    series = h.series(T0 + 9.0)
    b_rates = series["groups"]["b"]
    assert b_rates[6] is None and b_rates[7] is None  # b was in no quorum during 6..8
    assert b_rates[8] == pytest.approx(1.0)  # the one step it committed after healing
    assert max(r for r in b_rates if r is not None) <= 10.0
    assert series["quorum_size"][4:9] == [3, 3, 2, 2, 3]
    assert series["job"][5] == 0.0  # the stall: nothing committed in 5..6


def test_failure_is_live_before_the_survivors_go_on() -> None:
    h = History()
    steady(h, 0.0, 1.0, qid=1, step0=0, names=["a", "b"])
    h.apply(Expired(T0 + 3.0, B, last_seen=T0 + 1.0))
    (failure,) = h.view(T0 + 4.0)["failures"]
    assert failure["cause"] == "heartbeat expired"
    assert failure["state"] == "noticed"
    assert failure["went_on"] is None and failure["lost_s"] is None
    assert failure["down_s"] == pytest.approx(1.0)  # grows with ``now`` until healed


def test_a_lost_member_is_noticed_with_the_lighthouses_reason() -> None:
    h = History()
    steady(h, 0.0, 1.0, qid=1, step0=0, names=["a", "b"])
    h.apply(Lost(T0 + 1.05, B, reason="its session ended (connection ended)"))
    (failure,) = h.view(T0 + 1.1)["failures"]
    assert failure["cause"] == "its session ended (connection ended)"
    assert failure["noticed"] == pytest.approx(T0 + 1.05)


def test_a_kill_is_the_cause_even_when_the_session_end_arrived_first() -> None:
    h = History()
    step = steady(h, 0.0, 1.0, qid=1, step0=0, names=["a", "b"])
    h.apply(Lost(T0 + 1.01, B, reason="connection ended"))  # the manager exited at once...
    h.apply(KillRequested(T0 + 1.02, B))  # ...before the dashboard recorded the kill
    h.apply(quorum(1.3, 2, reason="Valid quorum found", a=step))
    (failure,) = h.view(T0 + 2.0)["failures"]
    assert failure["cause"] == "killed from dashboard"
    assert failure["noticed"] == pytest.approx(T0 + 1.01)


def test_a_member_that_said_goodbye_is_no_failure_until_a_quorum_lacks_it() -> None:
    h = History()
    step = steady(h, 0.0, 1.0, qid=1, step0=0, names=["a", "b"])
    h.apply(Lost(T0 + 1.05, B, reason="left: shutdown"))  # the job ended for b
    assert h.view(T0 + 1.1)["failures"] == []
    h.apply(quorum(1.3, 2, reason="Valid quorum found", a=step))
    (failure,) = h.view(T0 + 2.0)["failures"]
    assert failure["cause"] == "left: shutdown"


def test_the_recorder_takes_every_event_the_lighthouse_tells() -> None:
    # The lighthouse calls its observer by method name; one the recorder lacks is an error
    # logged on every such event (the dashboard missed every lost member until this test).
    from torchheal.coordination.lighthouse.dashboard.recorder import LighthouseRecorder
    from torchheal.coordination.lighthouse.server import LighthouseObserver

    told = [n for n, v in vars(LighthouseObserver).items() if callable(v) and n[0] != "_"]
    assert "lost" in told
    missing = [n for n in told if not callable(getattr(LighthouseRecorder, n, None))]
    assert not missing, f"LighthouseRecorder lacks {missing}"


def test_member_that_stops_asking_leaves_with_that_reason() -> None:
    h = History()
    step = steady(h, 0.0, 1.0, qid=1, step0=0, names=["a", "b"])
    h.apply(quorum(1.3, 2, reason="Valid quorum found", a=step))
    (failure,) = h.view(T0 + 2.0)["failures"]
    assert failure["cause"] == "did not ask to join"
    assert failure["noticed"] == failure["went_on"] == pytest.approx(T0 + 1.3)
    assert failure["state"] == "down"
    # A notice that arrives after the member already left changes nothing.
    h.apply(Expired(T0 + 6.0, B, last_seen=T0 + 1.0))
    assert len(h.view(T0 + 7.0)["failures"]) == 1


def test_same_replica_returning_is_a_return_not_a_restart() -> None:
    h = History()
    step = steady(h, 0.0, 1.0, qid=1, step0=0, names=["a", "b"])
    h.apply(quorum(1.3, 2, a=step))
    h.apply(quorum(1.4, 3, a=step + 1, b=step - 1))
    row = h.view(T0 + 2.0)["changes"][0]
    assert row["joined"][0]["why"] == f"returned, healing from step {step - 1} to {step + 1}"
    h.apply(quorum(1.5, 3, a=step + 2, b=step + 2))
    assert h.view(T0 + 2.0)["failures"][0]["state"] == "healed"


def test_commit_failures_moving_the_quorum_id_are_a_history_row() -> None:
    h = History()
    h.apply(quorum(0.0, 1, a=0, b=0))
    members = (MemberInfo(A, 1, commit_failures=2), MemberInfo(B, 1))
    h.apply(QuorumIssued(T0 + 0.1, 2, members, "Fast quorum found!", 0.001))
    row = h.view(T0 + 1.0)["changes"][0]
    assert row["quorum_id"] == 2 and row["joined"] == [] and row["left"] == []
    assert row["commit_failures"] == [{"replica_id": A, "commit_failures": 2}]
    assert h.view(T0 + 1.0)["members"][0]["commit_failures"] == 2


def test_history_is_bounded() -> None:
    h = History(HistoryLimits(buckets=5, changes=3, failures=2))
    for i in range(10):
        # Alternate membership so every round is a change and a departure.
        h.apply(quorum(float(i), i + 1, **({"a": i, "b": i} if i % 2 == 0 else {"a": i})))
    view = h.view(T0 + 10.0)
    assert [c["quorum_id"] for c in view["changes"]] == [10, 9, 8]
    assert len(view["failures"]) == 2
    assert len(h.series(T0 + 10.0)["t"]) == 5


def test_a_long_stall_fills_buckets_with_the_standing_quorum_size() -> None:
    h = History()
    h.apply(quorum(0.0, 1, a=0, b=0))
    h.apply(quorum(4.0, 1, a=1, b=1))
    series = h.series(T0 + 5.0)
    assert series["t"] == [T0 + i for i in range(5)]
    assert series["quorum_size"] == [2] * 5
    assert series["job"] == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_series_since_returns_only_newer_buckets() -> None:
    h = History()
    steady(h, 0.0, 3.0, qid=1, step0=0, names=["a"])
    assert h.series(T0 + 3.0, since=T0 + 1)["t"] == [T0 + 2]
    assert h.series(T0 + 3.0, since=T0 + 2)["t"] == []


def test_unknown_event_is_rejected() -> None:
    with pytest.raises(TypeError, match="not a dashboard event"):
        History().apply("quorum")  # type: ignore[arg-type]
