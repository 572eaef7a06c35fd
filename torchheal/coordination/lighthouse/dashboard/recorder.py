"""The lighthouse observer behind the dashboard and the metrics: counters plus an event queue.

Its methods run on the lighthouse's event-loop thread, so they only count and queue events; the
dashboard thread drains the queue and ``/metrics`` reads the counters. Nothing is locked: each
value has one writer, deque appends and pops are thread-safe, and a reader sees a value at most
one update old.
"""

from __future__ import annotations

import time
from collections import deque

from torchheal.coordination.guard_report import from_data
from torchheal.coordination.lighthouse.dashboard.events import (
    Event,
    Expired,
    Joined,
    KillRequested,
    Lost,
    MemberInfo,
    QuorumIssued,
    ReasonChanged,
)
from torchheal.coordination.types import Quorum, QuorumMember
from torchheal.metrics.stats import Histogram

__all__ = ["LighthouseRecorder"]

# Bounds the queue should the dashboard thread stop: the oldest events are then dropped.
MAX_QUEUED_EVENTS = 100_000
# Announced replica ids are forgotten past this (clearing only re-announces some groups).
MAX_SEEN_IDS = 100_000


class LighthouseRecorder:
    """Counts what the lighthouse does and queues events for the dashboard.

    A :class:`~torchheal.coordination.lighthouse.server.LighthouseObserver`. ``clock_offset``
    (wall-clock minus monotonic, default: measured now) stamps events so they stay ordered if
    the system clock is stepped.
    """

    def __init__(self, clock_offset: float | None = None) -> None:
        self._offset = time.time() - time.monotonic() if clock_offset is None else clock_offset
        self._events: deque[Event] = deque(maxlen=MAX_QUEUED_EVENTS)
        self._seen: set[str] = set()
        self._members: frozenset[str] = frozenset()
        #: Heartbeats received.
        self.heartbeats = 0
        #: Quorum requests received.
        self.requests = 0
        #: Quorums issued (one per round).
        self.rounds = 0
        #: Seconds from each round's first request to its quorum.
        self.round_seconds = Histogram()
        #: Members of a quorum that were not in the next one.
        self.members_lost = 0
        #: Members of a quorum that were not in the previous one (the first quorum's included).
        self.members_joined = 0
        #: Heartbeats that expired.
        self.expirations = 0
        #: The last issued quorum's id, size and highest step (0 before the first).
        self.quorum_id = 0
        self.quorum_size = 0
        self.max_step = 0

    def wall(self, monotonic: float) -> float:
        """Wall-clock seconds for a ``time.monotonic()`` value."""
        return monotonic + self._offset

    # ------------------------------------------------------------------------------------------
    # LighthouseObserver (lighthouse thread)

    def heartbeat(self, replica_id: str) -> None:
        """Count a heartbeat (the lighthouse's hottest path: nothing else happens here)."""
        self.heartbeats += 1

    def joined(self, member: QuorumMember, now: float) -> None:
        """Count a request; announce a replica id asking for the first time."""
        self.requests += 1
        rid = member.replica_id
        if rid not in self._seen:
            if len(self._seen) >= MAX_SEEN_IDS:
                self._seen.clear()
            self._seen.add(rid)
            self._events.append(Joined(self.wall(now), rid, member.step))

    def quorum_issued(self, quorum: Quorum, reason: str, round_s: float, now: float) -> None:
        """Count the round and queue the quorum."""
        members = tuple(
            MemberInfo(
                m.replica_id, m.step, m.address, m.commit_failures, m.world_size, from_data(m.data)
            )
            for m in quorum.participants
        )
        ids = frozenset(m.replica_id for m in members)
        self.rounds += 1
        self.round_seconds.observe(round_s)
        self.members_lost += len(self._members - ids)
        self.members_joined += len(ids - self._members)
        self._members = ids
        self.quorum_id = quorum.quorum_id
        self.quorum_size = len(members)
        self.max_step = max((m.step for m in members), default=0)
        self._events.append(
            QuorumIssued(self.wall(now), quorum.quorum_id, members, reason, round_s)
        )

    def expired(self, replica_id: str, last_seen: float, now: float) -> None:
        """Count and queue an expired heartbeat."""
        self.expirations += 1
        self._events.append(Expired(self.wall(now), replica_id, self.wall(last_seen)))

    def lost(self, replica_id: str, reason: str, now: float) -> None:
        """Queue a member of the current quorum lost (its session ended, or it expired)."""
        self._events.append(Lost(self.wall(now), replica_id, reason))

    def reason_changed(self, reason: str, now: float) -> None:
        """Queue the new quorum status."""
        self._events.append(ReasonChanged(self.wall(now), reason))

    # ------------------------------------------------------------------------------------------
    # Dashboard side (any thread)

    def killed(self, replica_id: str) -> None:
        """Record that the dashboard had a replica group's manager exit."""
        self._events.append(KillRequested(self.wall(time.monotonic()), replica_id))

    def drain(self) -> list[Event]:
        """Take every queued event, oldest first (one consumer at a time)."""
        events = []
        pop = self._events.popleft
        try:
            while True:
                events.append(pop())
        except IndexError:
            return events
