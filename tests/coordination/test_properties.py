"""Property tests of the pure coordination cores, over random histories (hypothesis).

Quorum: random interleavings of joins, heartbeats, clock advances and ticks, checking after every
tick the invariants the rest of the system relies on. Plan: random quorums, checking that the
per-rank results of all participants form one consistent recovery plan. Vote: random vote orders.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings, target
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st

from torchheal.coordination.plan import compute_quorum_results
from torchheal.coordination.quorum import (
    LighthouseConfig,
    LighthouseState,
    heartbeat,
    join,
    tick,
)
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp
from torchheal.coordination.vote import CommitVote

NAMES = ("a", "b", "c", "d", "e")
PROPERTY_SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass(frozen=True)
class Join:
    name: str
    step: int
    shrink_only: bool
    commit_failures: int


@dataclass(frozen=True)
class Beat:
    name: str


@dataclass(frozen=True)
class Advance:
    ms: int


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Round:
    """Several replicas ask together (as at a step boundary), then the lighthouse ticks."""

    names: frozenset[str]
    step: int
    commit_failures: int
    shrink_only: bool


names = st.sampled_from(NAMES)
events = st.one_of(
    st.builds(
        Join,
        names,
        st.integers(0, 5),
        # Mostly ordinary requests, so shrink_only rounds and commit failures stay occasional.
        st.sampled_from([False] * 7 + [True]),
        st.sampled_from([0] * 5 + [1]),
    ),
    st.builds(Beat, names),
    st.builds(Advance, st.sampled_from([10, 50, 100, 400, 1000, 3000])),
    st.just(Tick()),
    st.builds(
        Round,
        st.frozensets(names, min_size=1),
        st.integers(0, 5),
        st.sampled_from([0] * 4 + [1]),
        st.sampled_from([False] * 5 + [True]),
    ),
)
configs = st.builds(
    LighthouseConfig,
    min_replicas=st.integers(1, 3),
    join_timeout_ms=st.sampled_from([50, 200, 1000]),
    heartbeat_timeout_ms=st.sampled_from([300, 1000, 5000]),
)


def healthy_ids(state: LighthouseState, config: LighthouseConfig, now: float) -> set[str]:
    limit = config.heartbeat_timeout_ms / 1000.0
    return {rid for rid, seen in state.heartbeats.items() if now - seen < limit}


@PROPERTY_SETTINGS
@given(config=configs, history=st.lists(events, min_size=1, max_size=60))
def test_quorum_history_invariants(config: LighthouseConfig, history: list[object]) -> None:
    state = LighthouseState()
    now_ms = 0
    last_id = 0
    issued = 0
    flat: list[object] = []
    for event in [*history, Tick()]:
        if isinstance(event, Round):
            # The first member carries the round's shrink_only / commit_failures flags.
            for i, name in enumerate(sorted(event.names)):
                first = i == 0
                flat.append(
                    Join(
                        name,
                        event.step,
                        event.shrink_only and first,
                        event.commit_failures if first else 0,
                    )
                )
            flat.append(Tick())
        else:
            flat.append(event)
    for event in flat:
        now = now_ms / 1000.0
        if isinstance(event, Join):
            join(
                state,
                QuorumMember(
                    replica_id=event.name,
                    step=event.step,
                    shrink_only=event.shrink_only,
                    commit_failures=event.commit_failures,
                ),
                now,
            )
        elif isinstance(event, Beat):
            heartbeat(state, event.name, now)
        elif isinstance(event, Advance):
            now_ms += event.ms
        else:
            healthy = healthy_ids(state, config, now)
            healthy_participants = {
                rid: m for rid, (_, m) in state.participants.items() if rid in healthy
            }
            any_shrink = any(m.shrink_only for m in healthy_participants.values())
            joined = [t for rid, (t, _) in state.participants.items() if rid in healthy]
            prev = state.prev_quorum
            quorum, reason = tick(state, config, now, Timestamp())
            assert state.quorum_id >= last_id, "quorum ids never decrease"
            if quorum is None:
                assert state.quorum_id == last_id and state.prev_quorum is prev
                continue
            issued += 1
            got = [m.replica_id for m in quorum.participants]
            assert got == sorted(got) and len(set(got)) == len(got)
            assert got, "an issued quorum is never empty"
            assert set(got) <= set(healthy_participants), "only healthy requesters are included"
            assert quorum.quorum_id == state.quorum_id and state.prev_quorum == quorum
            assert state.participants == {}
            # The id moves exactly when membership changes or someone failed to commit.
            changed = prev is None or got != [m.replica_id for m in prev.participants]
            failures = any(m.commit_failures > 0 for m in quorum.participants)
            assert quorum.quorum_id == last_id + (1 if changed or failures else 0)
            if not any_shrink:
                assert set(got) == set(healthy_participants)
            elif prev is not None:
                # shrink_only: nobody outside the previous quorum gets in.
                assert set(got) <= {m.replica_id for m in prev.participants}
            hypothesis_event(reason.split(" [")[0].rstrip("!"))
            if reason.startswith("Fast quorum found!"):
                assert prev is not None
                # The fast path only ever keeps or grows the previous membership.
                assert {m.replica_id for m in prev.participants} <= set(got)
            else:
                assert reason.startswith("Valid quorum found")
                # Checks apply to the requesters; shrink_only may filter below them.
                assert len(healthy_participants) >= config.min_replicas
                assert len(healthy_participants) > len(healthy) // 2
                if len(healthy_participants) < len(healthy):
                    # Stragglers were only left behind after the join timeout (to within the
                    # core's nanosecond: 1.13 - 0.13 is 0.9999999999999999 in floats).
                    assert now - min(joined) >= config.join_timeout_ms / 1000.0 - 1e-9
                if not any_shrink:
                    assert len(got) >= config.min_replicas
                    assert len(got) > len(healthy) / 2
            last_id = quorum.quorum_id
    # Steer generation towards histories that issue many quorums (more invariants exercised).
    target(float(issued), label="issued quorums")


members = st.lists(
    st.tuples(st.text(alphabet="abcdxyz_0123", min_size=1, max_size=4), st.integers(0, 3)),
    min_size=1,
    max_size=7,
    unique_by=lambda pair: pair[0],
)


@PROPERTY_SETTINGS
@given(
    pairs=members,
    group_rank=st.integers(0, 5),
    init_sync=st.booleans(),
    failures=st.lists(st.integers(0, 3), min_size=7, max_size=7),
)
def test_plan_is_one_consistent_recovery(
    pairs: list[tuple[str, int]], group_rank: int, init_sync: bool, failures: list[int]
) -> None:
    quorum = Quorum(
        quorum_id=4,
        participants=tuple(
            QuorumMember(
                replica_id=rid,
                address=f"http://{rid}",
                store_address=f"{rid}:1",
                step=step,
                commit_failures=failures[i],
            )
            for i, (rid, step) in enumerate(pairs)
        ),
    )
    results = {rid: compute_quorum_results(rid, group_rank, quorum, init_sync) for rid, _ in pairs}
    ids = sorted(rid for rid, _ in pairs)
    step_of = dict(pairs)
    max_step = max(step_of.values())
    up_to_date_ids = [rid for rid in ids if step_of[rid] == max_step]
    primary = up_to_date_ids[group_rank % len(up_to_date_ids)]

    senders: Counter[int] = Counter()
    for rid, result in results.items():
        # Everyone sees the same quorum-wide facts.
        assert result.replica_ids == ids
        assert result.replica_ids[result.replica_rank] == rid
        assert result.replica_world_size == len(ids)
        assert (result.max_step, result.max_world_size) == (max_step, len(up_to_date_ids))
        assert result.store_address == f"{primary}:1"
        assert result.quorum_id == 4
        assert result.commit_failures == max(failures[: len(pairs)])
        if step_of[rid] == max_step:
            assert result.max_replica_rank == up_to_date_ids.index(rid)
        else:
            assert result.max_replica_rank is None

        must_heal = step_of[rid] != max_step or (init_sync and max_step == 0 and rid != primary)
        assert result.heal == must_heal
        assert not (result.heal and result.recover_dst_replica_ranks), "sends and heals"
        if result.heal:
            src = result.recover_src_replica_rank
            assert src is not None and src != result.replica_rank
            assert result.recover_src_manager_address == f"http://{ids[src]}"
            # The source is up to date, does not heal itself, and knows it sends to us.
            assert not results[ids[src]].heal
            assert result.replica_rank in results[ids[src]].recover_dst_replica_ranks
        else:
            assert result.recover_src_replica_rank is None
            assert result.recover_src_manager_address == ""
            senders[result.replica_rank] += 0
        for dst in result.recover_dst_replica_ranks:
            assert results[ids[dst]].recover_src_replica_rank == result.replica_rank
            senders[result.replica_rank] += 1

    # Each healer has exactly one source, and the load is spread evenly over the sources.
    healers = [rid for rid in ids if results[rid].heal]
    all_dsts = [d for r in results.values() for d in r.recover_dst_replica_ranks]
    assert sorted(all_dsts) == sorted(ids.index(rid) for rid in healers)
    if healers:
        assert max(senders.values()) - min(senders.values()) <= 1


@PROPERTY_SETTINGS
@given(
    world_size=st.integers(1, 5),
    data=st.data(),
)
def test_vote_decides_when_last_rank_votes(world_size: int, data: st.DataObject) -> None:
    votes = CommitVote(world_size)
    for step in range(3):
        order = data.draw(st.permutations(range(world_size)))
        ballots = {rank: data.draw(st.booleans()) for rank in order}
        # Duplicates (same ballot again) may arrive anywhere before the round closes.
        extra = data.draw(st.lists(st.sampled_from(order[:-1] or order), max_size=3))
        for position, rank in enumerate(order[:-1]):
            assert votes.cast(rank, step, ballots[rank]) is None
            for again in extra:
                if order.index(again) <= position:
                    assert votes.cast(again, step, ballots[again]) is None
        decision = votes.cast(order[-1], step, ballots[order[-1]])
        assert decision is not None and decision.step == step
        assert decision.commit == all(ballots.values())
        assert decision.failed_ranks == {r for r, ok in ballots.items() if not ok}
        assert votes.step is None
        if not decision.commit:
            # Retry the same step so the next step is not settled-stale; all yes this time.
            for rank in range(world_size):
                result = votes.cast(rank, step, True)
            assert result is not None and result.commit
