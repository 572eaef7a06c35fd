"""The lighthouse's memory and the plain updates to it: who asked, who is alive, what was issued.

Part of the pure quorum core (:mod:`~torchheal.coordination.quorum` decides on this state): no I/O,
no threads, no clock; ``now`` is monotonic seconds from the caller. Import via ``quorum``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchheal.coordination.types import Quorum, QuorumMember

__all__ = [
    "GAVE_UP_REASON",
    "LighthouseConfig",
    "LighthouseState",
    "forget_stale_heartbeats",
    "heartbeat",
    "join",
    "left_out",
    "lost_members",
    "requeue",
    "restore",
    "session_ended",
    "session_opened",
    "superseded",
    "withdraw",
]


@dataclass(frozen=True)
class LighthouseConfig:
    """Options of the quorum decision.

    Args:
        min_replicas: fewest replica groups a quorum may have outside the fast path (>= 1).
        join_timeout_ms: how long to wait for heartbeating replicas that have not asked to join,
            counted from the earliest healthy request of the round.
        quorum_tick_ms: period of the server's background tick (unused by the pure core).
        heartbeat_timeout_ms: a replica is healthy while its last heartbeat is younger than this.
    """

    min_replicas: int
    join_timeout_ms: int = 100
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        value = self.min_replicas
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"min_replicas must be an integer >= 1, got {value!r}")
        for name in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
            value = getattr(self, name)
            # bool is an int subclass; a flag passed by mistake is not a timeout.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass
class LighthouseState:
    """The lighthouse's whole memory; mutated only by the functions of this module.

    Args:
        participants: replica_id -> (joined_at, member) for requests waiting for a quorum.
        heartbeats: replica_id -> monotonic time it was last seen.
        prev_quorum: the last issued quorum, or None before the first.
        quorum_id: id of the last issued quorum; 0 before the first.
        prev_quorum_at: when ``prev_quorum`` was issued (None before the first).
        sessions: replicas with a live torchheal session: alive while it lasts, gone when it ends.
        restored: ``prev_quorum`` was learned (:func:`restore`), not issued here.
        fresh_id: the next quorum must take a new id: ids up to ``quorum_id`` may be in use by
            quorums this lighthouse did not issue.
        lineages: replica_id -> id of the quorum the group last committed or healed in (0: not
            said).
        redone: step -> the latest quorum id issued to train that step, for :func:`superseded`;
            the most recent :data:`REDONE_KEPT` steps.
    """

    participants: dict[str, tuple[float, QuorumMember]] = field(default_factory=dict)
    heartbeats: dict[str, float] = field(default_factory=dict)
    prev_quorum: Quorum | None = None
    quorum_id: int = 0
    prev_quorum_at: float | None = None
    sessions: set[str] = field(default_factory=set)
    restored: bool = False
    fresh_id: bool = False
    lineages: dict[str, int] = field(default_factory=dict)
    redone: dict[int, int] = field(default_factory=dict)


def heartbeat(state: LighthouseState, replica_id: str, now: float) -> None:
    """Record that ``replica_id`` is alive at ``now``."""
    state.heartbeats[replica_id] = now


def join(state: LighthouseState, member: QuorumMember, now: float, lineage: int = 0) -> None:
    """Register a quorum request; it also counts as a heartbeat.

    A second request from the same replica replaces the first and resets its join time, as in
    the reference. ``lineage``: the quorum the group last committed or healed in (0: unknown).
    """
    state.heartbeats[member.replica_id] = now
    state.participants[member.replica_id] = (now, member)
    state.lineages[member.replica_id] = lineage


def superseded(state: LighthouseState, member: QuorumMember) -> bool:
    """Whether ``member`` holds a commit that a later quorum trained again without it.

    A group that committed step ``s`` in quorum ``q``, then was declared lost while the others
    trained ``s`` again in a newer quorum, comes back level with them but with different
    weights; its step alone cannot tell (see docs/failures.md). Reference peers are never judged.
    """
    lineage = state.lineages.get(member.replica_id, 0)
    return lineage > 0 and state.redone.get(member.step - 1, 0) > lineage


def session_opened(state: LighthouseState, replica_id: str, now: float) -> None:
    """A replica group opened a torchheal session (its Hello arrived); it counts as a heartbeat."""
    state.sessions.add(replica_id)
    state.heartbeats[replica_id] = now


def session_ended(state: LighthouseState, replica_id: str) -> bool:
    """A replica group's session ended: the group is gone now, not when its heartbeat expires.

    The end of the stream is the lighthouse's own evidence, never a peer's claim, so the
    split-brain guard stays sound: a group still alive opens a new session and rejoins. Drops its
    pending request; returns whether it was in the last quorum (its peers must hear of it).
    """
    state.sessions.discard(replica_id)
    state.heartbeats.pop(replica_id, None)
    state.participants.pop(replica_id, None)
    prev = state.prev_quorum
    return prev is not None and any(m.replica_id == replica_id for m in prev.participants)


def restore(state: LighthouseState, quorum: Quorum, now: float) -> bool:
    """Learn of a quorum issued before this lighthouse (re)started; adopt it if it is newer.

    Ids never go backwards or repeat, since a group rebuilds its process group only when the id
    changes; and the restored members count as heard from now, so the first quorum after the
    restart is not issued to whichever group reconnects first. A quorum with no members, or one
    arriving after this lighthouse issued quorums, only moves the id. Returns whether it was newer.
    """
    if quorum.quorum_id <= state.quorum_id:
        return False
    state.quorum_id = quorum.quorum_id
    state.fresh_id = True
    if not quorum.participants:
        # Only an id (a group that restarted too reports the last id its store records): it
        # moves the id, but there is no membership to wait for.
        return True
    if state.prev_quorum is None or state.restored:
        state.prev_quorum = quorum
        state.prev_quorum_at = None
        state.restored = True
        for member in quorum.participants:
            state.heartbeats.setdefault(member.replica_id, now)
    return True


def lost_members(state: LighthouseState, config: LighthouseConfig, now: float) -> list[str]:
    """Sorted ids of the last quorum's members no longer healthy (gone, or heartbeat expired)."""
    prev = state.prev_quorum
    if prev is None:
        return []
    timeout_s = config.heartbeat_timeout_ms / 1000.0
    lost = []
    for member in prev.participants:
        seen = state.heartbeats.get(member.replica_id)
        if seen is None or now - seen >= timeout_s:
            lost.append(member.replica_id)
    return sorted(lost)


#: How a ``MemberLost`` reason begins when the group gave up building its process group.
GAVE_UP_REASON = "gave up building its process group"


def left_out(state: LighthouseState, before: Quorum | None, issued: Quorum) -> list[str]:
    """Sorted ids of ``before``'s members that ``issued`` left out while alive and not asking.

    Such a member still waits on ``before``, where nothing will complete: told, it need not wait
    for its own timeout. Reference peers have no session and are never told. Call it after
    ``issued`` was delivered (its left-out requesters put back).
    """
    if before is None or before.quorum_id == issued.quorum_id:
        return []
    kept = {m.replica_id for m in issued.participants}
    return sorted(
        m.replica_id
        for m in before.participants
        if m.replica_id not in kept
        and m.replica_id in state.sessions
        and m.replica_id not in state.participants
    )


def requeue(state: LighthouseState, member: QuorumMember, joined_at: float) -> None:
    """Put back a requester that an issued quorum left out, without counting a heartbeat.

    As the reference's "not in quorum, retrying": the request waits for the next quorum.
    """
    state.participants[member.replica_id] = (joined_at, member)


def withdraw(state: LighthouseState, member: QuorumMember) -> bool:
    """Take back a request that nobody waits for any more (its caller gave up or went away).

    Only that very request is taken out (a newer one of the same replica stays); returns
    whether it was still waiting.
    """
    entry = state.participants.get(member.replica_id)
    if entry is None or entry[1] is not member:
        return False
    del state.participants[member.replica_id]
    return True


def forget_stale_heartbeats(
    state: LighthouseState,
    now: float,
    older_than_s: float,
    *,
    config: LighthouseConfig | None = None,
) -> list[str]:
    """Drop heartbeat entries at least ``older_than_s`` old, so the map stays bounded.

    A missing heartbeat means the same as an expired one, so dropping entries older than the
    heartbeat timeout changes no decision; give ``config`` to have that checked (``ValueError``).
    Returns the forgotten ids, sorted.
    """
    if not older_than_s > 0:
        raise ValueError(f"older_than_s must be > 0, got {older_than_s!r}")
    if config is not None and older_than_s < config.heartbeat_timeout_ms / 1000.0:
        raise ValueError(
            f"older_than_s={older_than_s} is below heartbeat_timeout_ms="
            f"{config.heartbeat_timeout_ms}: it would forget replicas that are still healthy"
        )
    stale = sorted(rid for rid, seen in state.heartbeats.items() if now - seen >= older_than_s)
    for rid in stale:
        del state.heartbeats[rid]
    return stale
