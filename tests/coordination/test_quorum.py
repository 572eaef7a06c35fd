"""Unit tests of the lighthouse quorum decision (reference §4 and the Rust lighthouse tests of §12)."""

from __future__ import annotations

import pytest

from torchheal.coordination.quorum import (
    LighthouseConfig,
    LighthouseState,
    forget_stale_heartbeats,
    heartbeat,
    issue,
    join,
    left_out,
    propose,
    quorum_compute,
    requeue,
    restore,
    session_opened,
    tick,
)
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

WALL = Timestamp(seconds=1_700_000_000, nanos=5)


def member(replica_id: str, **kwargs: object) -> QuorumMember:
    return QuorumMember(
        replica_id=replica_id,
        address=f"http://{replica_id}:1",
        store_address=f"{replica_id}:2",
        world_size=1,
        **kwargs,  # type: ignore[arg-type]
    )


def ids(members: list[QuorumMember] | tuple[QuorumMember, ...] | None) -> list[str]:
    assert members is not None
    return [m.replica_id for m in members]


# --- configuration -------------------------------------------------------------------------


def test_config_defaults_and_valid() -> None:
    config = LighthouseConfig(min_replicas=1)
    config.validate()
    assert (config.join_timeout_ms, config.quorum_tick_ms, config.heartbeat_timeout_ms) == (
        100,
        100,
        5000,
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_replicas": 0}, "min_replicas"),
        ({"min_replicas": -3}, "min_replicas"),
        ({"min_replicas": True}, "min_replicas"),
        ({"min_replicas": 1, "join_timeout_ms": 0}, "join_timeout_ms"),
        ({"min_replicas": 1, "quorum_tick_ms": -1}, "quorum_tick_ms"),
        ({"min_replicas": 1, "heartbeat_timeout_ms": 0}, "heartbeat_timeout_ms"),
    ],
)
def test_config_validate_names_bad_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LighthouseConfig(**kwargs).validate()


# --- Rust lighthouse tests ------------------------------------------------------------------


def test_quorum_join_timeout() -> None:
    config = LighthouseConfig(min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=5000)
    state = LighthouseState()
    now = 100.0

    assert quorum_compute(state, config, now) == (
        None,
        "New quorum not ready, only have 0 participants, need min_replicas 1 "
        "[0/0 participants healthy][0 heartbeating][shrink_only=false]",
    )

    join(state, member("a"), now)
    join(state, member("b"), now + 1.0)
    heartbeat(state, "c", now)  # alive, but has not asked to join: a straggler
    assert quorum_compute(state, config, now + 1.0) == (
        None,
        "Valid quorum with 2 participants, waiting for 1 healthy but not participating "
        "stragglers due to join timeout [2/2 participants healthy][3 heartbeating]"
        "[shrink_only=false]",
    )

    # Everyone keeps heartbeating; still waiting just before the join timeout, which counts
    # from the earliest join (a's), not the latest.
    for t in (4.0, 8.0):
        for rid in ("a", "b", "c"):
            heartbeat(state, rid, now + t)
    candidates, reason = quorum_compute(state, config, now + 9.999)
    assert candidates is None
    assert reason.startswith("Valid quorum with 2 participants, waiting for 1 healthy")

    # Once the join timeout has passed, the quorum goes ahead without the straggler.
    candidates, reason = quorum_compute(state, config, now + 10.0)
    assert ids(candidates) == ["a", "b"]
    assert reason == (
        "Valid quorum found [2/2 participants healthy][3 heartbeating][shrink_only=false]"
    )

    # A straggler whose heartbeat expires is no longer waited for.
    fresh = LighthouseState()
    join(fresh, member("a"), now)
    join(fresh, member("b"), now)
    heartbeat(fresh, "c", now - 5.0)
    candidates, reason = quorum_compute(fresh, config, now)
    assert ids(candidates) == ["a", "b"]
    assert reason == (
        "Valid quorum found [2/2 participants healthy][2 heartbeating][shrink_only=false]"
    )


def test_quorum_heartbeats() -> None:
    config = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=5000)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    candidates, reason = quorum_compute(state, config, 0.0)
    assert ids(candidates) == ["a"]
    assert "[1/1 participants healthy][1 heartbeating]" in reason

    # Exactly heartbeat_timeout old is no longer healthy (strictly less than counts).
    candidates, reason = quorum_compute(state, config, 5.0)
    assert candidates is None
    assert reason == (
        "New quorum not ready, only have 0 participants, need min_replicas 1 "
        "[0/1 participants healthy][0 heartbeating][shrink_only=false]"
    )

    # A fresh heartbeat revives the still-registered participant.
    heartbeat(state, "a", 5.5)
    join(state, member("b"), 5.5)
    candidates, reason = quorum_compute(state, config, 6.0)
    assert ids(candidates) == ["a", "b"]
    assert "[2/2 participants healthy][2 heartbeating]" in reason

    # b's heartbeat expires while a keeps beating: b is excluded although registered.
    heartbeat(state, "a", 10.0)
    candidates, reason = quorum_compute(state, config, 10.5)
    assert ids(candidates) == ["a"]
    assert reason == (
        "Valid quorum found [1/2 participants healthy][1 heartbeating][shrink_only=false]"
    )


def test_quorum_fast_prev_quorum() -> None:
    config = LighthouseConfig(min_replicas=1, join_timeout_ms=60 * 60 * 1000)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    quorum, _ = tick(state, config, 0.0, WALL)
    assert quorum is not None and ids(quorum.participants) == ["a"]

    # b heartbeats without requesting: a lone a is not a strict majority of {a, b} ...
    heartbeat(state, "b", 1.0)
    join(state, member("a"), 1.0)
    # ... but the previous membership {a} is fully back, so the fast path skips that check.
    candidates, reason = quorum_compute(state, config, 1.0)
    assert ids(candidates) == ["a"]
    assert reason == (
        "Fast quorum found! [1/1 participants healthy][2 heartbeating][shrink_only=false]"
    )

    # Expansion through the fast path: b requests too and is let in at once.
    join(state, member("b"), 1.0)
    quorum, reason = tick(state, config, 1.0, WALL)
    assert quorum is not None and ids(quorum.participants) == ["a", "b"]
    assert reason.startswith("Fast quorum found!")
    assert quorum.quorum_id == 2


def test_fast_path_needs_every_previous_member() -> None:
    config = LighthouseConfig(min_replicas=1, join_timeout_ms=60 * 60 * 1000)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    join(state, member("b"), 0.0)
    assert tick(state, config, 0.0, WALL)[0] is not None
    # Only a asks again while b still heartbeats: no fast path, split-brain guard holds.
    join(state, member("a"), 1.0)
    heartbeat(state, "b", 1.0)
    candidates, reason = quorum_compute(state, config, 1.0)
    assert candidates is None
    assert "need at least half of 2 healthy workers" in reason


def test_quorum_shrink_only() -> None:
    config = LighthouseConfig(min_replicas=1, join_timeout_ms=60 * 60 * 1000)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    join(state, member("b"), 0.0)
    quorum, _ = tick(state, config, 0.0, WALL)
    assert quorum is not None and quorum.quorum_id == 1

    # Next round: a asks for shrink_only, c is new; b and c are filtered / kept apart.
    join(state, member("a", shrink_only=True), 1.0)
    join(state, member("b"), 1.0)
    join(state, member("c"), 1.0)
    candidates, reason = quorum_compute(state, config, 1.0)
    assert ids(candidates) == ["a", "b"]
    assert reason == (
        "Fast quorum found! [3/3 participants healthy][3 heartbeating][shrink_only=true]"
    )

    # Slow path keeps the filter; the checks count the unfiltered participants.
    state2 = LighthouseState(prev_quorum=quorum, quorum_id=1)
    join(state2, member("b", shrink_only=True), 10.0)
    join(state2, member("c"), 10.0)
    candidates, reason = quorum_compute(state2, config, 10.0)
    assert ids(candidates) == ["b"]
    assert reason == (
        "Valid quorum found [2/2 participants healthy][2 heartbeating][shrink_only=true]"
    )


def test_shrink_only_smaller_than_min_replicas() -> None:
    config = LighthouseConfig(min_replicas=2, join_timeout_ms=60 * 60 * 1000)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    join(state, member("b"), 0.0)
    quorum, _ = tick(state, config, 0.0, WALL)
    assert quorum is not None
    join(state, member("a", shrink_only=True), 100.0)
    join(state, member("z"), 100.0)
    candidates, _ = quorum_compute(state, config, 100.0)
    assert ids(candidates) == ["a"]  # 2 participants pass min_replicas; the filter leaves one


def test_shrink_only_leaving_no_candidate_waits() -> None:
    config = LighthouseConfig(min_replicas=1)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    assert tick(state, config, 0.0, WALL)[0] is not None
    join(state, member("z", shrink_only=True), 100.0)  # a has long expired
    quorum, reason = tick(state, config, 100.0, WALL)
    assert quorum is None
    assert reason == (
        "New quorum not ready, no candidates left after shrink_only filtering "
        "[1/1 participants healthy][1 heartbeating][shrink_only=true]"
    )
    assert state.quorum_id == 1 and ids(state.prev_quorum.participants) == ["a"]  # type: ignore[union-attr]


def test_quorum_split_brain() -> None:
    config = LighthouseConfig(min_replicas=1, join_timeout_ms=60 * 60 * 1000)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    heartbeat(state, "b", 0.0)
    candidates, reason = quorum_compute(state, config, 0.0)
    assert candidates is None
    assert reason == (
        "New quorum not ready, only have 1 participants, need at least half of 2 healthy "
        "workers [1/1 participants healthy][2 heartbeating][shrink_only=false]"
    )
    join(state, member("b"), 0.0)
    candidates, _ = quorum_compute(state, config, 0.0)
    assert ids(candidates) == ["a", "b"]


def test_quorum_changed() -> None:
    config = LighthouseConfig(min_replicas=1)
    state = LighthouseState()
    join(state, member("a", step=1), 0.0)
    join(state, member("b", step=1), 0.0)
    first, _ = tick(state, config, 0.0, WALL)
    assert first is not None and first.quorum_id == 1

    # Same ids with different addresses and steps: same quorum id.
    join(state, QuorumMember(replica_id="a", address="http://elsewhere:9", step=7), 1.0)
    join(state, QuorumMember(replica_id="b", store_address="x:1", step=8), 1.0)
    second, _ = tick(state, config, 1.0, WALL)
    assert second is not None and second.quorum_id == 1
    assert [m.step for m in second.participants] == [7, 8]

    # A different id list: new quorum id.
    join(state, member("a"), 2.0)
    join(state, member("b"), 2.0)
    join(state, member("c"), 2.0)
    third, _ = tick(state, config, 2.0, WALL)
    assert third is not None and third.quorum_id == 2


def test_lighthouse_join_during_shrink() -> None:
    config = LighthouseConfig(min_replicas=1, join_timeout_ms=60 * 60 * 1000)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    join(state, member("b"), 0.0)
    first, _ = tick(state, config, 0.0, WALL)
    assert first is not None and ids(first.participants) == ["a", "b"]

    # a asks to shrink while c joins: c is left out and keeps waiting (the server requeues it).
    join(state, member("a", shrink_only=True), 1.0)
    join(state, member("b"), 1.0)
    c = member("c")
    join(state, c, 1.0)
    shrunk, reason = tick(state, config, 1.0, WALL)
    assert shrunk is not None and ids(shrunk.participants) == ["a", "b"]
    assert "[shrink_only=true]" in reason
    assert shrunk.quorum_id == 1
    assert state.participants == {}
    requeue(state, c, 1.0)
    assert "c" in state.participants

    # The next non-shrink round lets c in through the fast path.
    join(state, member("a"), 2.0)
    join(state, member("b"), 2.0)
    grown, reason = tick(state, config, 2.0, WALL)
    assert grown is not None and ids(grown.participants) == ["a", "b", "c"]
    assert grown.quorum_id == 2
    assert reason.startswith("Fast quorum found!")


def test_lighthouse_commit_failures() -> None:
    config = LighthouseConfig(min_replicas=1)
    state = LighthouseState()
    issued = []
    for t, failures in ((0.0, 0), (1.0, 0), (2.0, 2)):
        join(state, member("replica0"), t)
        join(state, member("replica1", commit_failures=failures), t)
        quorum, _ = tick(state, config, t, WALL)
        assert quorum is not None
        issued.append(quorum.quorum_id)
    assert issued == [1, 1, 2]


# --- tick bookkeeping, helpers ----------------------------------------------------------


def test_tick_issues_sorted_quorum_and_clears_participants() -> None:
    config = LighthouseConfig(min_replicas=2)
    state = LighthouseState()
    quorum, reason = tick(state, config, 0.0, WALL)
    assert quorum is None and reason.startswith("New quorum not ready")
    assert state.quorum_id == 0 and state.prev_quorum is None

    join(state, member("b"), 0.0)
    join(state, member("a"), 0.0)
    quorum, reason = tick(state, config, 0.0, WALL)
    assert quorum == Quorum(quorum_id=1, participants=(member("a"), member("b")), created=WALL)
    assert state.prev_quorum == quorum
    assert state.participants == {}
    assert set(state.heartbeats) == {"a", "b"}
    # Nobody asked again: no new quorum, and the state is untouched.
    assert tick(state, config, 0.05, WALL)[0] is None
    assert state.quorum_id == 1


def test_join_overwrites_and_resets_joined_at() -> None:
    state = LighthouseState()
    join(state, member("a", step=1), 1.0)
    join(state, member("a", step=2), 4.0)
    assert state.participants["a"] == (4.0, member("a", step=2))
    assert state.heartbeats["a"] == 4.0


def test_requeue_does_not_heartbeat() -> None:
    state = LighthouseState()
    heartbeat(state, "a", 1.0)
    requeue(state, member("a"), 9.0)
    assert state.heartbeats["a"] == 1.0
    assert state.participants["a"] == (9.0, member("a"))


def test_forget_stale_heartbeats_keeps_healthy_and_decisions() -> None:
    config = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=5000)
    state = LighthouseState()
    heartbeat(state, "old", 0.0)
    heartbeat(state, "edge", 5.0)
    heartbeat(state, "fresh", 9.9)
    join(state, member("p"), 9.0)
    before = quorum_compute(state, config, 10.0)

    assert forget_stale_heartbeats(state, 10.0, 5.0, config=config) == ["edge", "old"]
    assert set(state.heartbeats) == {"fresh", "p"}
    # Reasons count heartbeating replicas only, so the decision is unchanged.
    assert quorum_compute(state, config, 10.0) == before


def test_forget_stale_heartbeats_rejects_unsafe_age() -> None:
    config = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=5000)
    state = LighthouseState(heartbeats={"a": 0.0})
    with pytest.raises(ValueError, match="heartbeat_timeout_ms"):
        forget_stale_heartbeats(state, 10.0, 4.9, config=config)
    with pytest.raises(ValueError, match="older_than_s"):
        forget_stale_heartbeats(state, 10.0, 0)
    assert state.heartbeats == {"a": 0.0}


def test_left_out_names_the_live_members_that_a_newer_quorum_left_out_while_they_worked() -> None:
    # a, b and c have torchheal sessions; d and e are reference peers (no session).
    config = LighthouseConfig(min_replicas=1)
    state = LighthouseState()
    for rid in "abc":
        session_opened(state, rid, 0.0)
    for rid in "abcde":
        join(state, member(rid), 0.0)
    first, _ = tick(state, config, 0.0, WALL)
    assert first is not None and ids(first.participants) == ["a", "b", "c", "d", "e"]
    assert left_out(state, None, first) == []
    # a, b and d come back from the step they committed; c is still at work in quorum 1
    # (alive: its session lasts), e too. After the wait for late members, quorum 2 goes on
    # without them.
    for rid in "abd":
        join(state, member(rid, step=1), 1.0)
    second = None
    now = 1.0
    while second is None:
        assert now < 4.0, "no quorum without the late members within their grace"
        heartbeat(state, "c", now)
        heartbeat(state, "e", now)
        second, _ = tick(state, config, now, WALL)
        now += 0.1
    assert ids(second.participants) == ["a", "b", "d"]
    # c is told its quorum is over; e has no session to be told on (as the reference).
    assert left_out(state, first, second) == ["c"]
    # A member that is asking was put back by the issue: it left quorum 1 already.
    requeue(state, member("c"), now)
    assert left_out(state, first, second) == []
    # The same quorum issued again (same id) leaves nobody out.
    assert left_out(state, second, second) == []


def test_propose_changes_nothing_until_issued() -> None:
    # A lighthouse saves a quorum before delivering it; one it could not save must leave the
    # state as it was (issue 40, bug 4).
    config = LighthouseConfig(min_replicas=1)
    state = LighthouseState()
    join(state, member("a"), 0.0)
    first, _ = tick(state, config, 0.0, WALL)
    assert first is not None
    join(state, member("a", step=1), 1.0)
    join(state, member("b", step=1), 1.0)
    before = (state.quorum_id, state.prev_quorum, state.prev_quorum_at, dict(state.participants))
    proposed, _ = propose(state, config, 1.0, WALL)
    assert proposed is not None and proposed.quorum_id == 2
    assert (state.quorum_id, state.prev_quorum, state.prev_quorum_at, state.participants) == before
    issue(state, proposed, 1.0)
    assert state.quorum_id == 2 and state.prev_quorum is proposed and not state.participants


def test_restore_of_an_id_alone_moves_only_the_id() -> None:
    # A group restarted with the lighthouse reports only the last id its store records
    # (issue 40, bug 3): there is no membership to adopt or wait for.
    config = LighthouseConfig(min_replicas=1)
    state = LighthouseState()
    assert restore(state, Quorum(quorum_id=7, participants=(), created=WALL), 0.0)
    assert state.quorum_id == 7 and state.prev_quorum is None and not state.heartbeats
    join(state, member("a"), 0.0)
    issued, _ = tick(state, config, 0.0, WALL)
    assert issued is not None and issued.quorum_id == 8
