"""A replica group's commit vote as its manager server runs it: one barrier, two kinds of voters.

Ranks > 0 vote over gRPC on the server's event loop; group rank 0 from its training thread.
:class:`GroupVote` lets both cast into one ``vote.CommitVote`` round under a lock and hands each a
thread-safe future, so the vote that completes a round answers at once: rank 0 voting last never
waits on the loop. A commit is overruled when the ``fence`` (``standing.py``), asked once the last
vote is in, says the group may have been dropped from the step's quorum.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

from torchheal.coordination.vote import CommitVote, Decision

__all__ = ["GroupVote"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.vote")


class GroupVote:
    """The commit vote of one replica group, safe to cast into from any thread.

    Args:
        world_size: the ranks that vote on every step.
        log_prefix: prefixes log lines (``[Replica name]``).
        fence: returns why the group may have been dropped from the step's quorum, or None;
            asked when a round decides to commit (None: never overruled).
        committed: called (under the vote's lock) when a round's commit stands.
    """

    def __init__(
        self,
        world_size: int,
        log_prefix: str,
        fence: Callable[[], str | None] | None = None,
        committed: Callable[[int], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._vote = CommitVote(world_size)
        self._round: concurrent.futures.Future[Decision] | None = None
        self._prefix = log_prefix
        self._fence = fence
        self._committed = committed

    @property
    def step(self) -> int | None:
        """The step being decided (None between rounds)."""
        with self._lock:
            return self._vote.step

    @property
    def voted(self) -> frozenset[int]:
        """The ranks that voted in the round in progress."""
        with self._lock:
            return frozenset(self._vote.voted)

    @property
    def last_decision(self) -> Decision | None:
        """The last round's decision."""
        with self._lock:
            return self._vote.last_decision

    def cast(
        self, rank: int, step: int, vote: bool, salvageable: bool = False
    ) -> concurrent.futures.Future[Decision]:
        """Cast ``rank``'s vote on ``step``; the returned future holds the round's decision
        (already done when this vote completed it). ``ValueError`` as :meth:`CommitVote.cast`."""
        with self._lock:
            decision = self._vote.cast(rank, step, vote, salvageable)
            if decision is not None and decision.commit and self._fence is not None:
                why = self._fence()
                if why is not None:
                    decision = self._vote.overrule(why)
            if decision is not None and decision.commit and self._committed is not None:
                self._committed(step + 1)
            round_ = self._round
            if round_ is None:
                round_ = self._round = concurrent.futures.Future()
            if decision is not None:
                self._round = None
        if decision is not None:
            # Per step, so DEBUG; a failed vote is worth a user's attention.
            if decision.overruled is not None:
                logger.warning(
                    "%s step %d: should_commit=False although every rank voted yes: the "
                    "lighthouse may have dropped this group during the step (%s), and its "
                    "peers may have redone the step without it; if they committed it, this "
                    "group heals from them at its next quorum",
                    self._prefix,
                    decision.step,
                    decision.overruled,
                )
            elif not decision.commit:
                logger.info(
                    "%s step %d: should_commit=False (failed ranks: %s)%s",
                    self._prefix,
                    decision.step,
                    sorted(decision.failed_ranks),
                    "; every rank redoes it" if decision.redo else "",
                )
            elif logger.isEnabledFor(logging.DEBUG):
                logger.debug("%s step %d: should_commit=True", self._prefix, decision.step)
            round_.set_result(decision)
        return round_

    def abandon(self, error: Exception) -> None:
        """Fail the round in progress (the server is going away); its voters get ``error``."""
        with self._lock:
            round_, self._round = self._round, None
            self._vote.reset()
        if round_ is not None and not round_.done():
            round_.set_exception(error)
