"""Whether the lighthouse may have dropped this group during its step, judged from inside.

A group frozen past its heartbeat timeout does not know, when it wakes, that its peers redid the
step without it; its collective may still complete and it would commit. :meth:`Standing.doubt`
says whether it may have been dropped since it last asked for a quorum: a gap of at least
``limit_s`` between two ticks of its heartbeat loop (or one still open), or the lighthouse's notice.

Not counted: the lighthouse being unreachable, or the session ending with it. That is no stall
of the group (its peers' collectives complete as its own does), and counting it would make every
group heal at every lighthouse failover.

A doubt costs one heal; a drop not doubted could split the job's weights. Plain data: the caller
passes the time in, in seconds, and holds any lock.
"""

from __future__ import annotations

__all__ = ["Standing", "limit_for"]

#: The share of the lighthouse's heartbeat timeout that a gap must reach to be doubted.
SHARE_OF_TIMEOUT = 0.5


def limit_for(heartbeat_timeout_s: float, heartbeat_interval_s: float) -> float:
    """The stall of the group's loop at which the lighthouse may have expired the group.

    Half the lighthouse's timeout (room for network delay), and never less than two heartbeat
    intervals, so that the loop's regular pace is never taken for a stall.
    """
    if not heartbeat_timeout_s > 0 or not heartbeat_interval_s > 0:
        raise ValueError(
            f"heartbeat timeout and interval must be > 0, got {heartbeat_timeout_s!r} and "
            f"{heartbeat_interval_s!r}"
        )
    return max(SHARE_OF_TIMEOUT * heartbeat_timeout_s, 2.0 * heartbeat_interval_s)


class Standing:
    """What one group saw of its own standing with the lighthouse since its last quorum request.

    Args:
        limit_s: the doubted gap between two ticks (:func:`limit_for`; ``ValueError`` if not > 0).
        now: the time the link opened; it counts as the first tick.
    """

    def __init__(self, limit_s: float, now: float) -> None:
        self.limit_s = limit_s
        self._ticked_at = now
        # Why the group may have been dropped since it last asked (the first reason seen).
        self._doubt: str | None = None
        # Whether it asked again since the last quorum it received: the step of that quorum
        # has been voted on, and a notice about it crossed the new request.
        self._asked_since_received = False

    @property
    def limit_s(self) -> float:
        """The doubted gap between two ticks, in seconds."""
        return self._limit_s

    @limit_s.setter
    def limit_s(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"limit_s must be > 0, got {value!r}")
        self._limit_s = value

    def asked(self) -> None:
        """The group asked the lighthouse for a quorum: what came before no longer counts.

        The lighthouse can only issue that quorum with the group in it if it holds the group
        alive, whatever happened before the request.
        """
        self._doubt = None
        self._asked_since_received = True

    def received(self) -> None:
        """The lighthouse's answer, a quorum, arrived: the group is at work in it."""
        self._asked_since_received = False

    def tick(self, now: float) -> float | None:
        """The heartbeat loop ran at ``now``; returns the gap since the last tick if doubted."""
        gap = now - self._ticked_at
        self._ticked_at = now
        if gap < self._limit_s:
            return None
        self._note(f"this process was stalled for {gap:.2f}s, its heartbeats with it")
        return gap

    def lost(self, quorum_id: int, reason: str) -> bool:
        """The lighthouse says this group is lost from ``quorum_id``; returns whether doubted.

        Not after the group asked again (a notice missed without a session comes after the next
        Welcome): that quorum's step was voted on before, and the lighthouse answers the request
        only with the group alive.
        """
        if self._asked_since_received:
            return False
        self._note(f"the lighthouse dropped it from quorum {quorum_id} ({reason})")
        return True

    def doubt(self, now: float) -> str | None:
        """Why the lighthouse may have dropped the group since it last asked, or None (a gap
        still open at ``now`` counts)."""
        if self._doubt is not None:
            return self._doubt
        stalled_s = now - self._ticked_at
        if stalled_s >= self._limit_s:
            return f"this process has been stalled for {stalled_s:.2f}s, its heartbeats with it"
        return None

    def _note(self, why: str) -> None:
        if self._doubt is None:
            self._doubt = why
