"""One replica group's quorum round inside its manager server, as plain data (reference §5).

The server (``group/server.py``) makes one lighthouse request once all ranks have asked, and
only carries requests, time (``now`` in seconds) and answers to these objects. Rules:

* each rank's latest request counts until its deadline passes or it leaves;
* the last rank speaks for ``shrink_only`` and ``commit_failures``, as in the reference, but the
  group's step is its lowest rank's, so a heal that failed on some ranks makes all heal again;
* the group's ``data`` is its rank 0's (rank 0's Manager alone reports the group);
* :class:`RetryPolicy` says, after a failed lighthouse attempt, whether and when to retry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchheal.coordination.types import QuorumMember

__all__ = ["GiveUp", "Joined", "QuorumRound", "Retry", "RetryPolicy", "RoundStart"]


@dataclass(frozen=True)
class RoundStart:
    """The group is complete: ask the lighthouse now.

    Args:
        round_id: the round that started.
        member: the last rank's request, at the lowest rank's step, with rank 0's ``data``.
        timeout_s: that rank's remaining time, which bounds the lighthouse request.
    """

    round_id: int
    member: QuorumMember
    timeout_s: float


@dataclass(frozen=True)
class Joined:
    """What a rank's request did to the round.

    Args:
        round_id: the round the rank now waits on.
        start: set when this request completed the round.
    """

    round_id: int
    start: RoundStart | None = None


@dataclass(frozen=True)
class _Request:
    member: QuorumMember
    deadline: float


class QuorumRound:
    """Collects the quorum requests of the ranks of one replica group.

    Args:
        world_size: the group's number of ranks (>= 1).
    """

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        self._world_size = world_size
        self._round_id = 0
        self._requests: dict[int, _Request] = {}

    @property
    def round_id(self) -> int:
        """The round now open (it has not started)."""
        return self._round_id

    @property
    def waiting(self) -> frozenset[int]:
        """The group ranks counted in the open round (deadlines are checked at the next join)."""
        return frozenset(self._requests)

    def check(self, group_rank: int, step: int, commit_failures: int) -> None:
        """Validate a request before it joins (``ValueError`` naming the impossible value)."""
        if not 0 <= group_rank < self._world_size:
            raise ValueError(
                f"group_rank {group_rank} is outside [0, {self._world_size}) for a replica group "
                f"of world_size {self._world_size}"
            )
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if commit_failures < 0:
            raise ValueError(f"commit_failures must be >= 0, got {commit_failures}")

    def join(self, group_rank: int, member: QuorumMember, now: float, remaining: float) -> Joined:
        """A rank asks for a quorum, waiting ``remaining`` seconds; replaces its earlier request."""
        for rank in [r for r, request in self._requests.items() if request.deadline <= now]:
            del self._requests[rank]
        self._requests[group_rank] = _Request(member, now + remaining)
        if len(self._requests) < self._world_size:
            return Joined(self._round_id)
        lowest = min(request.member.step for request in self._requests.values())
        data = self._requests[0].member.data  # (every rank is in, so rank 0 is)
        if lowest < member.step or data is not member.data:
            member = dataclasses.replace(member, step=lowest, data=data)
        start = RoundStart(self._round_id, member, remaining)
        self._requests = {}
        self._round_id += 1
        return Joined(start.round_id, start)

    def leave(self, group_rank: int, round_id: int, member: QuorumMember) -> bool:
        """A rank gave up waiting; take out that very request if its round has not started."""
        request = self._requests.get(group_rank)
        if round_id != self._round_id or request is None or request.member is not member:
            return False
        del self._requests[group_rank]
        return True


@dataclass(frozen=True)
class Retry:
    """Try the lighthouse again.

    Args:
        sleep_s: the pause before the next attempt.
    """

    sleep_s: float


@dataclass(frozen=True)
class GiveUp:
    """Stop: every waiting rank gets this failure.

    Args:
        timed_out: the last attempt ran out of time (a deadline status), else an internal one.
        message: what the ranks are told.
    """

    timed_out: bool
    message: str


@dataclass(frozen=True)
class RetryPolicy:
    """How a round retries its lighthouse request (reference §5).

    Args:
        retries: extra attempts after the first failure.
        min_sleep_s: the shortest pause between attempts.
    """

    retries: int
    min_sleep_s: float = 0.1

    def after_failure(
        self, attempt: int, timeout_s: float, *, got_status: bool, timed_out: bool, error: str
    ) -> Retry | GiveUp:
        """What to do after attempt number ``attempt`` (0-based) failed.

        A call that ended with a gRPC status pauses for a share of ``timeout_s`` so attempts
        spread over it; one our own timer abandoned (no status) retries after the minimum pause.
        """
        if attempt >= self.retries:
            return GiveUp(
                timed_out=timed_out,
                message=f"lighthouse quorum failed after {self.retries} retries. last error: "
                f"{error}",
            )
        if got_status:
            return Retry(max(self.min_sleep_s, timeout_s / (self.retries + 1)))
        return Retry(self.min_sleep_s)
