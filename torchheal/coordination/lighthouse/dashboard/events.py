"""What the dashboard learns from the lighthouse, as plain immutable values.

The recorder (``recorder.py``) turns the lighthouse's observer calls into these events, stamped
with wall-clock seconds; the pure history (``history.py``) folds them into what the page shows.
Tests build them by hand, so the history is tested without sockets, threads or clocks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from torchheal.coordination.guard_report import GuardReport

__all__ = [
    "Event",
    "Expired",
    "Joined",
    "KillRequested",
    "Lost",
    "MemberInfo",
    "QuorumIssued",
    "ReasonChanged",
    "group_name",
]


def group_name(replica_id: str) -> str:
    """The replica group's stable name: its replica id without the per-start uuid.

    A Manager registers as ``{name}:{uuid4}`` with a fresh uuid at every start, so a restarted
    group has a new replica id; the dashboard follows the group across restarts by this name.

    Args:
        replica_id: the id the replica group uses with the lighthouse.
    """
    name, sep, suffix = replica_id.rpartition(":")
    if not sep or not name:
        return replica_id
    try:
        uuid.UUID(suffix)
    except ValueError:
        return replica_id
    return name


@dataclass(frozen=True)
class MemberInfo:
    """A quorum member as the dashboard needs it.

    Args:
        replica_id: the member's full replica id.
        step: the step it reported when it asked to join (its committed steps).
        address: its manager server URL.
        commit_failures: consecutive failed commits it reported.
        world_size: ranks in its replica group.
        guard: its divergence guard's report, from its request's ``data`` (None: it sent
            none, as a reference group or a group with the guard off).
    """

    replica_id: str
    step: int
    address: str = ""
    commit_failures: int = 0
    world_size: int = 1
    guard: GuardReport | None = None


@dataclass(frozen=True)
class QuorumIssued:
    """The lighthouse issued a quorum.

    Args:
        t: wall-clock seconds.
        quorum_id: the quorum's id.
        members: its members, sorted by replica id.
        reason: the lighthouse's reason string for issuing it.
        round_s: seconds from the round's first request to the quorum.
    """

    t: float
    quorum_id: int
    members: tuple[MemberInfo, ...]
    reason: str
    round_s: float


@dataclass(frozen=True)
class Joined:
    """A replica id asked to join a quorum for the first time (a group started or restarted).

    Args:
        t: wall-clock seconds.
        replica_id: the requester.
        step: the step it reported.
    """

    t: float
    replica_id: str
    step: int


@dataclass(frozen=True)
class Expired:
    """A replica's heartbeat expired: the lighthouse no longer counts it as alive.

    Args:
        t: wall-clock seconds when the lighthouse noticed.
        replica_id: the silent replica.
        last_seen: wall-clock seconds of its last heartbeat.
    """

    t: float
    replica_id: str
    last_seen: float


@dataclass(frozen=True)
class Lost:
    """A member of the current quorum is gone on the lighthouse's own evidence.

    Args:
        t: wall-clock seconds when the lighthouse noticed.
        replica_id: the lost replica.
        reason: why (its session ended, its heartbeat expired), as the lighthouse says it.
    """

    t: float
    replica_id: str
    reason: str


@dataclass(frozen=True)
class KillRequested:
    """The dashboard asked a replica group's manager to exit, and it accepted.

    Args:
        t: wall-clock seconds.
        replica_id: the killed replica.
    """

    t: float
    replica_id: str


@dataclass(frozen=True)
class ReasonChanged:
    """The lighthouse's quorum status (the reason of its latest decision) changed.

    Args:
        t: wall-clock seconds.
        reason: the new reason string.
    """

    t: float
    reason: str


Event = QuorumIssued | Joined | Expired | Lost | KillRequested | ReasonChanged
