"""The per-step commit decision of one replica group, as plain data (reference §5, §6.7).

Each rank's vote (:func:`local_vote`, :func:`ballot`), the group's barrier over those votes
(:class:`CommitVote`, held by the manager server under its lock) and the limit on consecutive
failed commits (:func:`retry_limit_error`). The group commits only if nobody voted no.

Beyond the reference (which ignores ``step``): votes carry the step, so a vote left over from an
earlier round can neither complete nor corrupt another step's round (:class:`StaleVoteError`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Ballot",
    "CommitVote",
    "Decision",
    "StaleVoteError",
    "ballot",
    "local_vote",
    "retry_limit_error",
]


def local_vote(num_participants: int, min_replica_size: int, errored: bool) -> bool:
    """One rank's vote: the step failed nowhere here, and enough replicas took part in it."""
    if errored:
        return False
    return num_participants >= min_replica_size


@dataclass(frozen=True)
class Ballot:
    """One rank's vote on its step (:func:`ballot`).

    Args:
        vote: yes or no.
        step: the step voted on.
        heal_target: the step of a heal its counters have not reached yet (0: none).
    """

    vote: bool
    step: int
    heal_target: int


def ballot(
    *, step: int, heal_target: int, num_participants: int, min_replica_size: int, errored: bool
) -> Ballot:
    """One rank's vote on its step: :func:`local_vote`, on the step its group healed to.

    A heal that failed on this rank leaves its counters behind while its peers may have healed
    to ``heal_target``. The rank votes no on that step, and on no lower one, until its counters
    get there: a vote for another step than its peers' would be refused as stale, and the
    group, seen at its lowest rank's step, heals again.
    """
    if step >= heal_target:
        # Reached: a later rollback of the counters is the user's.
        return Ballot(local_vote(num_participants, min_replica_size, errored), step, 0)
    return Ballot(False, heal_target, heal_target)


def retry_limit_error(commit_failures: int, max_retries: int | None) -> str | None:
    """The fatal error once more than ``max_retries`` (None: no limit) commits in a row failed."""
    if max_retries is None or commit_failures <= max_retries:
        return None
    # Worded as the reference's; its tests match this text.
    return (
        f"should_commit failed {commit_failures} times consecutively, "
        f"exceeding max_retries={max_retries}"
    )


class StaleVoteError(ValueError):
    """A vote for another step than the one being decided, or for a step already decided.

    Args:
        message: what was expected and what arrived.
        vote_step: the step the rejected vote was for.
        expected_step: the step of the round in progress, or None if no round is open.
    """

    def __init__(self, message: str, vote_step: int, expected_step: int | None) -> None:
        super().__init__(message)
        self.vote_step = vote_step
        self.expected_step = expected_step


@dataclass(frozen=True)
class Decision:
    """The outcome of one commit round.

    Args:
        step: the step that was voted on.
        commit: True iff every rank voted to commit.
        failed_ranks: the group ranks that voted not to commit.
        redo: (torchheal only) no commit, but every "no" said a redo in a new quorum would
            cure it: the whole group redoes the step and votes again (``salvage_step``).
        overruled: (torchheal only) why a unanimous yes was overruled because the group may
            have been dropped from the step's quorum (``Standing.doubt``); None when it stood.
    """

    step: int
    commit: bool
    failed_ranks: frozenset[int]
    redo: bool = False
    overruled: str | None = None


class CommitVote:
    """Collect the commit votes of the ``world_size`` ranks of one replica group, step by step.

    A round opens with the first vote and takes its step; it closes with a :class:`Decision`
    when all ranks ``0..world_size-1`` have voted. Rules:

    * A vote for another step than the open round's raises :class:`StaleVoteError`.
    * With no round open, a vote for a settled step raises :class:`StaleVoteError`: below the
      last decided one, or equal to it when that round committed. A retry of a step that did
      not commit is a new round.
    * A rank voting again is counted once, and its "no" sticks (as the reference's set-based
      barrier); so does a "no" that no redo would cure.
    * When every "no" of a round says a redo would cure it (``salvageable``), the decision is
      a redo: no commit, and the ranks redo the step together and vote again.

    Args:
        world_size: number of ranks in the replica group (>= 1).
    """

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self._world_size = world_size
        self._step: int | None = None
        self._voted: set[int] = set()
        self._failed: set[int] = set()
        self._incurable: set[int] = set()
        self._last: Decision | None = None

    @property
    def world_size(self) -> int:
        """Number of ranks that must vote in each round."""
        return self._world_size

    @property
    def step(self) -> int | None:
        """Step of the round in progress, or None when no vote is pending."""
        return self._step

    @property
    def voted(self) -> frozenset[int]:
        """Group ranks that have voted in the round in progress."""
        return frozenset(self._voted)

    @property
    def last_decision(self) -> Decision | None:
        """The most recent decision, or None before the first."""
        return self._last

    def cast(
        self, group_rank: int, step: int, vote: bool, salvageable: bool = False
    ) -> Decision | None:
        """Record one rank's vote; return the :class:`Decision` if it completed the round.

        ``salvageable`` (with a "no"): a redo of the step in a new quorum would cure it. Raises
        ``ValueError`` for a bad rank or step, :class:`StaleVoteError` for a stale step.
        """
        if isinstance(group_rank, bool) or not isinstance(group_rank, int):
            raise ValueError(f"group_rank must be an integer, got {group_rank!r}")
        if not 0 <= group_rank < self._world_size:
            raise ValueError(
                f"group_rank {group_rank} is outside [0, {self._world_size}) "
                f"for a replica group of world_size {self._world_size}"
            )
        if step < 0:
            # Impossible, as for a quorum request (round.QuorumRound.check).
            raise ValueError(f"step must be >= 0, got {step}")
        if self._step is None:
            self._check_not_settled(group_rank, step)
            self._step = step
        elif step != self._step:
            raise StaleVoteError(
                f"group_rank {group_rank} voted for step {step} while step {self._step} "
                "is being decided",
                vote_step=step,
                expected_step=self._step,
            )

        self._voted.add(group_rank)
        if not vote:
            self._failed.add(group_rank)
            if not salvageable:
                self._incurable.add(group_rank)
        if len(self._voted) < self._world_size:
            return None

        decision = Decision(
            step=step,
            commit=not self._failed,
            failed_ranks=frozenset(self._failed),
            redo=bool(self._failed) and not self._incurable,
        )
        self._last = decision
        self._clear_round()
        return decision

    def overrule(self, why: str) -> Decision:
        """Turn the commit just decided into a failure: the group may have been dropped (``why``).

        The ranks then retry the step (the reference's contract for a "no"), healing first.
        Returns the replacing decision; ``RuntimeError`` unless the last decision was a commit
        and no new round has opened.
        """
        last = self._last
        if last is None or not last.commit or self._step is not None:
            raise RuntimeError("only a commit decision, before the next round opens, is overruled")
        self._last = Decision(step=last.step, commit=False, failed_ranks=frozenset(), overruled=why)
        return self._last

    def reset(self) -> None:
        """Abort the round in progress (its votes are forgotten); settled steps stay settled."""
        self._clear_round()

    def _check_not_settled(self, group_rank: int, step: int) -> None:
        last = self._last
        if last is None:
            return
        if step < last.step or (step == last.step and last.commit):
            outcome = "committed" if last.commit else "did not commit"
            raise StaleVoteError(
                f"group_rank {group_rank} voted for step {step}, but step {last.step} was "
                f"already decided ({outcome}); expected a vote for step "
                f"{last.step + 1 if last.commit else last.step} or later",
                vote_step=step,
                expected_step=None,
            )

    def _clear_round(self) -> None:
        self._step = None
        self._voted.clear()
        self._failed.clear()
        self._incurable.clear()
