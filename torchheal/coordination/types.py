"""Plain value types of the coordination protocol.

These mirror the reference's wire messages (`QuorumMember`, `Quorum`, `ManagerQuorumResponse`) as
Python values, so the pure cores (`quorum.py`, `plan.py`) never touch protobuf. Conversion to and
from the wire lives in `convert.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: a pure core imports nothing that could read a clock
    from datetime import timedelta


@dataclass(frozen=True)
class QuorumMember:
    """One replica group as it presents itself to the lighthouse.

    Args:
        replica_id: unique id of the replica group (the manager adds a uuid suffix).
        address: the group's manager server URL, ``http://host:port``.
        store_address: ``host:port`` of the group's TCPStore.
        step: the group's current step.
        world_size: number of ranks in the group.
        shrink_only: the group asks for a quorum that only drops members.
        data: opaque JSON object set by ``LighthouseClient.quorum`` users (``None`` if absent).
        commit_failures: consecutive failed commits; > 0 forces a new quorum id.
    """

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    data: dict[str, Any] | None = None
    commit_failures: int = 0


@dataclass(frozen=True)
class Timestamp:
    """Wall-clock time as protobuf's ``google.protobuf.Timestamp``.

    Args:
        seconds: whole seconds since the Unix epoch.
        nanos: fraction of a second in nanoseconds.
    """

    seconds: int = 0
    nanos: int = 0

    @classmethod
    def from_float(cls, t: float) -> Timestamp:
        secs = int(t)
        return cls(seconds=secs, nanos=round((t - secs) * 1e9) % 1_000_000_000)

    def to_float(self) -> float:
        return self.seconds + self.nanos / 1e9


@dataclass(frozen=True)
class Quorum:
    """A membership decision of the lighthouse.

    Args:
        quorum_id: increases whenever membership changes or a member reports failed commits.
        participants: members sorted by ``replica_id``.
        created: when the lighthouse issued it.
    """

    quorum_id: int
    participants: tuple[QuorumMember, ...] = ()
    created: Timestamp = field(default_factory=Timestamp)


@dataclass(frozen=True)
class QuorumAsk:
    """One rank's request to join its group's quorum round (``ManagerClient._quorum``'s arguments).

    ``data`` becomes the group's ``QuorumMember.data`` when the caller is group rank 0 (its
    divergence-guard report, ``guard_report.py``); other ranks' is not sent on.
    """

    group_rank: int
    step: int
    checkpoint_metadata: str
    shrink_only: bool
    init_sync: bool
    commit_failures: int
    timeout: timedelta
    data: dict[str, Any] | None = None


@dataclass
class QuorumResult:
    """What one rank of one replica group needs to know about a quorum.

    Mutable with defaults, like the reference's binding.

    Args:
        quorum_id: id of the quorum this result belongs to.
        replica_rank: this group's index among the participants (sorted by replica_id).
        replica_world_size: number of participating groups.
        recover_src_manager_address: manager URL of the group to heal from ("" if not healing).
        recover_src_replica_rank: replica rank of the group to heal from, or None.
        recover_dst_replica_ranks: replica ranks this group must send its state to.
        store_address: TCPStore used to rendezvous the cross-group process group.
        max_step: highest step among participants.
        max_replica_rank: this group's index among the up-to-date groups, or None if behind.
        max_world_size: number of up-to-date groups.
        heal: whether this group must receive state before it can commit.
        commit_failures: highest commit_failures reported by any participant.
        replica_ids: participants' replica ids in replica-rank order.
    """

    quorum_id: int = 0
    replica_rank: int = 0
    replica_world_size: int = 1
    recover_src_manager_address: str = ""
    recover_src_replica_rank: int | None = None
    recover_dst_replica_ranks: list[int] = field(default_factory=list)
    store_address: str = ""
    max_step: int = 0
    max_replica_rank: int | None = None
    max_world_size: int = 1
    heal: bool = False
    commit_failures: int = 0
    replica_ids: list[str] = field(default_factory=list)


class NoticeKind(enum.Enum):
    """What a lighthouse notice about a member of a quorum says (``MemberLost`` on the wire)."""

    #: Another group of the quorum is gone (its session ended, its heartbeat expired), or gave
    #: up building the quorum's process group: nothing waited on from it in that quorum comes.
    LOST = "lost"
    #: This group (one of its ranks) gave up building the quorum's process group.
    GAVE_UP = "gave_up"
    #: This group was dropped from the quorum (frozen past its heartbeat timeout, or its
    #: session ended): its peers may have trained the step again without it.
    DROPPED = "dropped"
    #: This group was left out of a newer quorum while still at work in this one: its peers
    #: went on, after completing this quorum's collectives with it.
    SUPERSEDED = "superseded"


@dataclass(frozen=True)
class Notice:
    """A lighthouse notice as a group's ranks act on it, decoded once (``convert.notice_from_pb``).

    Args:
        kind: what it says (see :class:`NoticeKind`).
        replica_id: the group it is about.
        quorum_id: the quorum it is about.
        reason: why, for the logs.
        gave_up: (``LOST``) the group gave up building the quorum's process group; it is alive.
        steps_done: (``LOST``) steps the group had committed when it said goodbye (0: not said).
    """

    kind: NoticeKind
    replica_id: str
    quorum_id: int
    reason: str
    gave_up: bool = False
    steps_done: int = 0
