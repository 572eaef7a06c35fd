"""What one rank of one replica group does with an issued quorum (reference §5, §6.3).

The one home of *my replica rank, who is up to date, whose TCPStore hosts the rendezvous, who
heals from whom* (:func:`compute_quorum_results`, in each manager server) and of *who contributes
to this step's reductions, with which rank, divided by how many* (:func:`participation`, in the
Manager). Pure: every group computes the same plan from the same quorum, so all agree unspoken.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from torchheal.coordination.types import Quorum, QuorumResult

__all__ = [
    "NotParticipatingError",
    "Participation",
    "WorldSizeMode",
    "compute_quorum_results",
    "participation",
]


class NotParticipatingError(LookupError):
    """The replica asking for its result is not a participant of the quorum.

    Args:
        replica_id: the replica that was looked for.
    """

    def __init__(self, replica_id: str) -> None:
        # Worded as the reference's; its tests match this text.
        super().__init__(f"replica {replica_id} not participating in returned quorum")
        self.replica_id = replica_id


def compute_quorum_results(
    replica_id: str, group_rank: int, quorum: Quorum, init_sync: bool
) -> QuorumResult:
    """Compute one rank's view of a quorum: its ranks, store and recovery assignment.

    Replica ranks are positions in the participants sorted by ``replica_id``. Groups behind
    ``max_step`` heal; with ``init_sync`` and everyone at step 0, every group except this group
    rank's primary heals from it, so all start from identical weights. Healers are spread
    round-robin over the up-to-date groups, offset by ``group_rank`` so that different group
    ranks of a healer pull from different sources. Raises :class:`NotParticipatingError`.
    """
    # Sorting here (not trusting the lighthouse) keeps every group's plan identical even if a
    # peer lighthouse sent participants in another order.
    participants = sorted(quorum.participants, key=lambda member: member.replica_id)
    ids = [member.replica_id for member in participants]
    try:
        replica_rank = ids.index(replica_id)
    except ValueError:
        raise NotParticipatingError(replica_id) from None

    max_step = max(member.step for member in participants)
    up_to_date_members = [member for member in participants if member.step == max_step]
    max_replica_rank: int | None = None
    for index, member in enumerate(up_to_date_members):
        if member.replica_id == replica_id:
            max_replica_rank = index
            break

    # One primary per group rank spreads the rendezvous load over the up-to-date groups.
    primary = up_to_date_members[group_rank % len(up_to_date_members)]
    force_recover = init_sync and max_step == 0

    dst_all: list[int] = []
    up_to_date: list[int] = []
    for index, member in enumerate(participants):
        behind = member.step != max_step
        if behind or (force_recover and member.replica_id != primary.replica_id):
            dst_all.append(index)
        else:
            up_to_date.append(index)

    # up_to_date always holds the primary, so the modulo below never divides by zero.
    assign: dict[int, list[int]] = {}
    recover_src_replica_rank: int | None = None
    for k, dst in enumerate(dst_all):
        src = up_to_date[(k + group_rank) % len(up_to_date)]
        assign.setdefault(src, []).append(dst)
        if dst == replica_rank:
            recover_src_replica_rank = src

    recover_src_manager_address = (
        participants[recover_src_replica_rank].address
        if recover_src_replica_rank is not None
        else ""
    )

    return QuorumResult(
        quorum_id=quorum.quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(participants),
        recover_src_manager_address=recover_src_manager_address,
        recover_src_replica_rank=recover_src_replica_rank,
        recover_dst_replica_ranks=assign.get(replica_rank, []),
        store_address=primary.store_address,
        max_step=max_step,
        max_replica_rank=max_replica_rank,
        max_world_size=len(up_to_date_members),
        heal=recover_src_replica_rank is not None,
        commit_failures=max((member.commit_failures for member in participants), default=0),
        replica_ids=ids,
    )


class WorldSizeMode(Enum):
    """How many replicas contribute to a step (public in ``torchheal.manager``).

    DYNAMIC: every up-to-date replica contributes; an average divides by their count.
    FIXED_WITH_SPARES: at most ``min_replica_size`` replicas contribute; the ones ranked beyond
        that are spares that send zeros, so the divisor never changes while spares are left.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


@dataclass(frozen=True)
class Participation:
    """One replica's part in this step's cross-replica reductions.

    Args:
        rank: its index among the contributors; None when it only keeps the collectives in
            step without contributing (a spare, or behind).
        count: how many replicas contribute; what an averaged reduction divides by.
    """

    rank: int | None
    count: int

    def contributes(self, healing: bool) -> bool:
        """Whether this replica's data counts this step; not while it is still ``healing``
        (asynchronous quorum only: a synchronous one heals before computing anything)."""
        return self.rank is not None and not healing


def participation(
    result: QuorumResult,
    use_async_quorum: bool,
    allow_heal: bool,
    world_size_mode: WorldSizeMode,
    min_replica_size: int,
) -> Participation:
    """Who contributes to this step, seen from the replica that received ``result``.

    An asynchronous quorum heals too late for the healer's gradients to be right, so then (and
    when healing is off) only replicas at ``max_step`` count and healers send zeros; a
    synchronous one heals before the forward pass, so every member counts. With spares the
    divisor is capped at ``min_replica_size`` and those ranked beyond it send zeros.
    ``allow_heal`` is this step's ``start_quorum`` argument.
    """
    heals_before_compute = allow_heal and not use_async_quorum
    if heals_before_compute:
        rank, count = result.replica_rank, result.replica_world_size
    else:
        rank, count = result.max_replica_rank, result.max_world_size
    if world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
        count = min(count, min_replica_size)
        if rank is not None and rank >= min_replica_size:
            rank = None
    return Participation(rank=rank, count=count)
