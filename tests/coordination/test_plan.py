"""Unit tests of the per-rank quorum result (reference §5 and the Rust manager tests of §12)."""

from __future__ import annotations

import pytest

from torchheal.coordination.plan import NotParticipatingError, compute_quorum_results
from torchheal.coordination.types import Quorum, QuorumMember, QuorumResult, Timestamp


def quorum_of(steps: list[int], commit_failures: list[int] | None = None) -> Quorum:
    failures = commit_failures or [0] * len(steps)
    return Quorum(
        quorum_id=1,
        participants=tuple(
            QuorumMember(
                replica_id=f"replica_{i}",
                address=f"addr_{i}",
                store_address=f"store_addr_{i}",
                step=step,
                world_size=1,
                commit_failures=failures[i],
            )
            for i, step in enumerate(steps)
        ),
        created=Timestamp(seconds=1),
    )


def test_compute_quorum_results_first_step() -> None:
    quorum = quorum_of([0, 0])

    # group rank 0: replica_0 is the primary and sends to replica_1.
    r0 = compute_quorum_results("replica_0", 0, quorum, True)
    assert not r0.heal
    assert r0.replica_rank == 0
    assert r0.recover_src_replica_rank is None
    assert r0.recover_dst_replica_ranks == [1]
    assert r0.store_address == "store_addr_0"

    r1 = compute_quorum_results("replica_1", 0, quorum, True)
    assert r1.heal
    assert r1.replica_rank == 1
    assert r1.recover_src_replica_rank == 0
    assert r1.recover_src_manager_address == "addr_0"
    assert r1.recover_dst_replica_ranks == []

    # group rank 1: the primary is replica_1 and replica_0 heals from it.
    r0 = compute_quorum_results("replica_0", 1, quorum, True)
    assert r0.heal
    assert r0.recover_src_replica_rank == 1
    assert r0.recover_src_manager_address == "addr_1"
    assert r0.store_address == "store_addr_1"
    r1 = compute_quorum_results("replica_1", 1, quorum, True)
    assert not r1.heal
    assert r1.recover_dst_replica_ranks == [0]


def test_compute_quorum_results_recovery() -> None:
    quorum = quorum_of([0, 1, 0, 1, 0])

    r0 = compute_quorum_results("replica_0", 0, quorum, True)
    assert r0.heal
    assert r0.recover_src_replica_rank == 1
    assert r0.recover_src_manager_address == "addr_1"
    assert r0.max_step == 1
    assert r0.max_replica_rank is None
    assert r0.max_world_size == 2
    assert r0.replica_world_size == 5

    r1 = compute_quorum_results("replica_1", 0, quorum, True)
    assert not r1.heal
    assert r1.recover_src_replica_rank is None
    assert r1.recover_dst_replica_ranks == [0, 4]
    assert r1.max_replica_rank == 0

    r3 = compute_quorum_results("replica_3", 0, quorum, True)
    assert not r3.heal
    assert r3.recover_dst_replica_ranks == [2]
    assert r3.max_replica_rank == 1

    # group rank 1 shifts the round-robin: replica_1 now sends to replica_2.
    r1 = compute_quorum_results("replica_1", 1, quorum, True)
    assert r1.recover_dst_replica_ranks == [2]
    assert r1.store_address == "store_addr_3"


def test_compute_quorum_results_skip_init_sync() -> None:
    quorum = quorum_of([0, 0])
    for rid in ("replica_0", "replica_1"):
        result = compute_quorum_results(rid, 0, quorum, False)
        assert not result.heal
        assert result.recover_dst_replica_ranks == []
        assert result.max_world_size == 2

    quorum = quorum_of([1, 0])
    r1 = compute_quorum_results("replica_1", 0, quorum, False)
    assert r1.heal
    assert r1.recover_src_replica_rank == 0
    r0 = compute_quorum_results("replica_0", 0, quorum, False)
    assert r0.recover_dst_replica_ranks == [1]


def test_compute_quorum_results_commit_failures() -> None:
    quorum = quorum_of([0, 0], commit_failures=[0, 2])
    assert compute_quorum_results("replica_0", 0, quorum, True).commit_failures == 2
    assert compute_quorum_results("replica_1", 0, quorum, True).commit_failures == 2
    assert compute_quorum_results("replica_0", 0, quorum_of([3]), True).commit_failures == 0


def test_single_replica_full_result() -> None:
    quorum = Quorum(
        quorum_id=7,
        participants=(
            QuorumMember(
                replica_id="rep",
                address="http://h:1",
                store_address="h:2",
                step=123,
                world_size=2,
                commit_failures=3,
            ),
        ),
    )
    assert compute_quorum_results("rep", 1, quorum, True) == QuorumResult(
        quorum_id=7,
        replica_rank=0,
        replica_world_size=1,
        recover_src_manager_address="",
        recover_src_replica_rank=None,
        recover_dst_replica_ranks=[],
        store_address="h:2",
        max_step=123,
        max_replica_rank=0,
        max_world_size=1,
        heal=False,
        commit_failures=3,
        replica_ids=["rep"],
    )


def test_unsorted_participants_are_sorted() -> None:
    quorum = quorum_of([5, 5])
    reversed_quorum = Quorum(quorum_id=1, participants=tuple(reversed(quorum.participants)))
    result = compute_quorum_results("replica_1", 0, reversed_quorum, True)
    assert result.replica_rank == 1
    assert result.replica_ids == ["replica_0", "replica_1"]


def test_not_participating() -> None:
    with pytest.raises(NotParticipatingError) as info:
        compute_quorum_results("ghost", 0, quorum_of([1, 2]), True)
    assert str(info.value) == "replica ghost not participating in returned quorum"
    assert isinstance(info.value, LookupError)
    assert info.value.replica_id == "ghost"
    with pytest.raises(NotParticipatingError):
        compute_quorum_results("ghost", 0, Quorum(quorum_id=1), True)
