"""Unit tests of the per-step commit barrier of one replica group."""

from __future__ import annotations

import pytest

from torchheal.coordination.vote import Ballot, CommitVote, Decision, StaleVoteError, ballot


def test_should_commit_all_true() -> None:
    votes = CommitVote(world_size=3)
    assert votes.cast(0, 5, True) is None
    assert votes.cast(2, 5, True) is None
    assert votes.step == 5 and votes.voted == frozenset({0, 2})
    assert votes.cast(1, 5, True) == Decision(step=5, commit=True, failed_ranks=frozenset())
    assert votes.step is None and votes.voted == frozenset()


def test_should_commit_one_false_fails_everyone() -> None:
    votes = CommitVote(world_size=2)
    assert votes.cast(1, 0, False) is None
    decision = votes.cast(0, 0, True)
    assert decision == Decision(step=0, commit=False, failed_ranks=frozenset({1}))
    assert votes.last_decision == decision


def test_single_rank_decides_at_once() -> None:
    votes = CommitVote(world_size=1)
    assert votes.cast(0, 0, True) == Decision(0, True, frozenset())
    assert votes.cast(0, 1, False) == Decision(1, False, frozenset({0}))


def test_rounds_reset_between_steps() -> None:
    votes = CommitVote(world_size=2)
    votes.cast(0, 1, False)
    assert votes.cast(1, 1, True) is not None
    # The failed round's "no" does not leak into the retry of the same step.
    votes.cast(0, 1, True)
    assert votes.cast(1, 1, True) == Decision(1, True, frozenset())
    votes.cast(1, 2, True)
    assert votes.cast(0, 2, True) == Decision(2, True, frozenset())


def test_a_round_whose_every_no_is_salvageable_is_redone_by_every_rank() -> None:
    votes = CommitVote(world_size=3)
    votes.cast(0, 4, True)
    votes.cast(2, 4, False, salvageable=True)
    decision = votes.cast(1, 4, True)
    assert decision == Decision(4, False, frozenset({2}), redo=True)
    # The redo is voted on in a new round of the same step (the last one did not commit).
    for rank in (0, 1):
        votes.cast(rank, 4, True)
    assert votes.cast(2, 4, True) == Decision(4, True, frozenset())


@pytest.mark.parametrize(
    "votes_cast",
    [
        # One "no" no redo would cure vetoes the redo, in either order, even from the same rank.
        [(0, False, True), (1, False, False)],
        [(1, False, False), (0, False, True)],
        [(0, False, True), (0, False, False), (1, True, False)],
        # Nothing failed: nothing to redo ("salvageable" means nothing beside a "yes").
        [(0, True, True), (1, True, False)],
    ],
)
def test_no_redo_unless_every_no_is_salvageable(votes_cast: list[tuple[int, bool, bool]]) -> None:
    votes = CommitVote(world_size=2)
    decisions = [votes.cast(rank, 7, vote, salvageable) for rank, vote, salvageable in votes_cast]
    assert decisions[-1] is not None and decisions[-1].redo is False, decisions


def test_vote_for_other_step_is_stale() -> None:
    votes = CommitVote(world_size=2)
    votes.cast(0, 7, True)
    with pytest.raises(StaleVoteError, match=r"step 6 while step 7 is being decided") as info:
        votes.cast(1, 6, True)
    assert isinstance(info.value, ValueError)
    assert (info.value.vote_step, info.value.expected_step) == (6, 7)
    with pytest.raises(StaleVoteError, match=r"step 8 while step 7"):
        votes.cast(1, 8, False)
    # The rejected votes changed nothing: rank 1 still completes the round with a yes.
    assert votes.voted == frozenset({0})
    assert votes.cast(1, 7, True) == Decision(7, True, frozenset())


def test_vote_for_settled_step_is_stale() -> None:
    votes = CommitVote(world_size=2)
    votes.cast(0, 3, True)
    votes.cast(1, 3, True)
    # Step 3 committed: a late duplicate for it must not open a round that blocks step 4.
    with pytest.raises(StaleVoteError, match=r"step 3 was already decided \(committed\)"):
        votes.cast(1, 3, True)
    with pytest.raises(StaleVoteError, match="voted for step 2"):
        votes.cast(0, 2, True)
    assert votes.step is None
    assert votes.cast(0, 4, False) is None
    assert votes.cast(1, 4, True) == Decision(4, False, frozenset({0}))
    # Step 4 did not commit, so a retry of step 4 is a new round; step 3 stays stale.
    with pytest.raises(StaleVoteError, match=r"did not commit"):
        votes.cast(0, 3, True)
    assert votes.cast(0, 4, True) is None
    assert votes.cast(1, 4, True) == Decision(4, True, frozenset())


def test_steps_may_jump_forward() -> None:
    votes = CommitVote(world_size=1)
    votes.cast(0, 2, True)
    assert votes.cast(0, 40, True) == Decision(40, True, frozenset())  # after healing


def test_duplicate_vote_is_idempotent_and_no_sticks() -> None:
    votes = CommitVote(world_size=3)
    assert votes.cast(0, 1, True) is None
    assert votes.cast(0, 1, True) is None
    assert votes.voted == frozenset({0})
    assert votes.cast(1, 1, False) is None
    assert votes.cast(1, 1, True) is None  # a later yes does not erase the no
    assert votes.cast(2, 1, True) == Decision(1, False, frozenset({1}))


def test_reset_aborts_round_in_progress() -> None:
    votes = CommitVote(world_size=2)
    votes.cast(0, 9, False)
    votes.reset()
    assert votes.step is None and votes.voted == frozenset()
    # After an abort the round starts from scratch, for any step not yet settled.
    assert votes.cast(1, 10, True) is None
    assert votes.cast(0, 10, True) == Decision(10, True, frozenset())
    votes.reset()
    assert votes.last_decision == Decision(10, True, frozenset())


@pytest.mark.parametrize("rank", [-1, 2, 99])
def test_invalid_group_rank(rank: int) -> None:
    votes = CommitVote(world_size=2)
    with pytest.raises(ValueError, match=rf"group_rank {rank} is outside \[0, 2\)"):
        votes.cast(rank, 0, True)
    assert votes.step is None


def test_invalid_group_rank_type() -> None:
    with pytest.raises(ValueError, match="group_rank must be an integer"):
        CommitVote(world_size=2).cast(True, 0, True)  # type: ignore[arg-type]


@pytest.mark.parametrize("world_size", [0, -2, True, 1.5])
def test_invalid_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match="world_size"):
        CommitVote(world_size=world_size)  # type: ignore[arg-type]


def test_an_overruled_commit_is_a_failed_step_that_the_group_retries() -> None:
    votes = CommitVote(world_size=2)
    votes.cast(0, 4, True)
    assert votes.cast(1, 4, True) == Decision(4, True, frozenset())
    overruled = votes.overrule("its heartbeats stopped for 3.00s")
    assert overruled == Decision(
        4, False, frozenset(), overruled="its heartbeats stopped for 3.00s"
    )
    assert votes.last_decision == overruled
    # The step did not commit: its retry is a new round, not a stale vote.
    votes.cast(1, 4, True)
    assert votes.cast(0, 4, True) == Decision(4, True, frozenset())


def test_only_a_commit_just_decided_is_overruled() -> None:
    votes = CommitVote(world_size=2)
    with pytest.raises(RuntimeError, match="only a commit decision"):
        votes.overrule("why")  # nothing decided yet
    votes.cast(0, 0, False)
    votes.cast(1, 0, True)
    with pytest.raises(RuntimeError, match="only a commit decision"):
        votes.overrule("why")  # not a commit
    votes.cast(0, 0, True)
    votes.cast(1, 0, True)
    votes.cast(0, 1, True)
    with pytest.raises(RuntimeError, match="only a commit decision"):
        votes.overrule("why")  # the next round has opened
    assert votes.step == 1


def test_a_ballot_votes_on_the_step_its_group_healed_to_until_the_counters_get_there() -> None:
    yes = dict(num_participants=2, min_replica_size=1, errored=False)
    assert ballot(step=5, heal_target=0, **yes) == Ballot(True, 5, 0)
    assert ballot(step=5, heal_target=0, num_participants=1, min_replica_size=2, errored=False) == (
        Ballot(False, 5, 0)
    )
    assert ballot(step=5, heal_target=0, num_participants=2, min_replica_size=1, errored=True) == (
        Ballot(False, 5, 0)
    )
    # A heal to 7 failed on this rank: it votes no on 7, its group's step, until it gets there.
    assert ballot(step=5, heal_target=7, **yes) == Ballot(False, 7, 7)
    assert ballot(step=7, heal_target=7, **yes) == Ballot(True, 7, 0)
