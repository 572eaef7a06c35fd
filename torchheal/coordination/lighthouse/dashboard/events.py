"""What the dashboard learns from the lighthouse, as plain immutable values.

``recorder.py`` makes these events (``t``: wall-clock seconds) and ``history.py`` folds them;
tests build them by hand.
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

    A Manager registers as ``{name}:{uuid4}`` with a fresh uuid at every start; the dashboard
    follows the group across restarts by this name.
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
    """A quorum member as the dashboard needs it."""

    replica_id: str
    step: int  # the step it reported when it asked to join
    address: str = ""  # its manager server URL
    commit_failures: int = 0  # consecutive
    world_size: int = 1
    guard: GuardReport | None = None  # from its request's data (None: it sent none)


@dataclass(frozen=True)
class QuorumIssued:
    """The lighthouse issued a quorum."""

    t: float
    quorum_id: int
    members: tuple[MemberInfo, ...]  # sorted by replica id
    reason: str
    round_s: float  # from the round's first request to the quorum


@dataclass(frozen=True)
class Joined:
    """A replica id asked to join a quorum for the first time (a group started or restarted)."""

    t: float
    replica_id: str
    step: int


@dataclass(frozen=True)
class Expired:
    """A replica's heartbeat expired: the lighthouse no longer counts it as alive."""

    t: float
    replica_id: str
    last_seen: float  # its last heartbeat


@dataclass(frozen=True)
class Lost:
    """A member of the current quorum is gone on the lighthouse's own evidence (``reason``)."""

    t: float
    replica_id: str
    reason: str


@dataclass(frozen=True)
class KillRequested:
    """The dashboard asked a replica group's manager to exit, and it accepted."""

    t: float
    replica_id: str


@dataclass(frozen=True)
class ReasonChanged:
    """The lighthouse's quorum status (the reason of its latest decision) changed."""

    t: float
    reason: str


Event = QuorumIssued | Joined | Expired | Lost | KillRequested | ReasonChanged
