"""The lighthouse's memory and the plain updates to it: who asked, who is alive, what was issued.

Part of the pure quorum core (:mod:`torchheal.coordination.quorum` decides; this module holds the
state it decides on and the events that change it: requests, heartbeats, sessions, restores,
withdrawals). Nothing here does I/O, starts threads or reads a clock: ``now`` is a monotonic time
in float seconds supplied by the caller. Import these names from ``quorum``, which re-exports them.
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
        quorum_tick_ms: period of the server's background tick (kept here so one object carries
            all lighthouse options; the pure core does not use it).
        heartbeat_timeout_ms: a replica is healthy while its last heartbeat is younger than this.
    """

    min_replicas: int
    join_timeout_ms: int = 100
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000

    def validate(self) -> None:
        """Check every field; raise ``ValueError`` naming the first bad one.

        Raises:
            ValueError: ``min_replicas`` < 1 or a timeout that is not > 0.
        """
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
        quorum_id: id of the last issued quorum; 0 before the first, so the first is 1.
        prev_quorum_at: monotonic time ``prev_quorum`` was issued (None before the first).
        sessions: replicas with a live torchheal session: the lighthouse knows they are alive
            for as long as it lasts, and that they are gone as soon as it ends.
        restored: ``prev_quorum`` was learned (:func:`restore`), not issued by this lighthouse.
        fresh_id: the next issued quorum must take a new id, whatever its membership: ids up
            to ``quorum_id`` may be in use by quorums this lighthouse did not issue.
        lineages: replica_id -> the id of the quorum whose history the group holds (it last
            committed or healed in it), as its latest request said (torchheal groups; 0: not
            said).
        redone: step -> the latest quorum id issued to train that step (its highest member
            step): a group that committed the step in an older quorum holds a history that
            was superseded (:func:`superseded`). The most recent :data:`REDONE_KEPT` steps.
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
    """Record that ``replica_id`` is alive at ``now``.

    Args:
        state: the lighthouse state to update.
        replica_id: the replica group's full id.
        now: monotonic time in seconds.
    """
    state.heartbeats[replica_id] = now


def join(state: LighthouseState, member: QuorumMember, now: float, lineage: int = 0) -> None:
    """Register a quorum request; it also counts as a heartbeat.

    A second request from the same replica overwrites the first and resets its join time, as in
    the reference.

    Args:
        state: the lighthouse state to update.
        member: the requester as it presents itself.
        now: monotonic time in seconds.
        lineage: the id of the quorum the group last committed or healed in (0: unknown, as
            for a reference peer, which is never judged).
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
    """A replica group opened a torchheal session (its Hello arrived); it counts as a heartbeat.

    Args:
        state: the lighthouse state to update.
        replica_id: the group's full id.
        now: monotonic time in seconds.
    """
    state.sessions.add(replica_id)
    state.heartbeats[replica_id] = now


def session_ended(state: LighthouseState, replica_id: str) -> bool:
    """A replica group's session ended: the group is gone now, not when its heartbeat expires.

    The end of the stream is the lighthouse's own evidence, never a peer's claim, so the
    split-brain guard stays sound: a group still alive opens a new session and rejoins. Its
    pending request, if any, is dropped.

    Args:
        state: the lighthouse state to update.
        replica_id: the group's full id.

    Returns:
        Whether the group was a member of the last issued quorum (its peers must hear of it).
    """
    state.sessions.discard(replica_id)
    state.heartbeats.pop(replica_id, None)
    state.participants.pop(replica_id, None)
    prev = state.prev_quorum
    return prev is not None and any(m.replica_id == replica_id for m in prev.participants)


def restore(state: LighthouseState, quorum: Quorum, now: float) -> bool:
    """Learn of a quorum issued before this lighthouse (re)started; adopt it if it is newer.

    Two rules keep a restart safe. Ids never go backwards or repeat, since a group rebuilds its
    process group only when the id changes. And the restored quorum's members count as heard
    from now, so the first quorum after the restart is not issued to whichever group reconnects
    first. A quorum with no members moves only the id; an older one changes nothing; a newer
    one arriving after this lighthouse issued quorums only moves the id.

    Args:
        state: the lighthouse state to update.
        quorum: the reported quorum (its members as they were when it was issued).
        now: monotonic time in seconds.

    Returns:
        Whether the quorum was newer than any known and was adopted.
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
    """Members of the last issued quorum that are no longer healthy (gone, or heartbeat expired).

    Args:
        state: the lighthouse state.
        config: the quorum options (the heartbeat timeout).
        now: monotonic time in seconds.

    Returns:
        Their replica ids, sorted.
    """
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


#: How the reason of a ``MemberLost`` notice about a group that gave up building its quorum's
#: process group begins, for the logs (the notice's ``gave_up`` field says so too).
GAVE_UP_REASON = "gave up building its process group"


def left_out(state: LighthouseState, before: Quorum | None, issued: Quorum) -> list[str]:
    """Members of ``before`` that ``issued`` left out while they are alive and not asking.

    Such a member still waits on ``before``, where nothing will complete any more: told, it
    need not wait for its own timeout. Reference peers have no session and are never told.

    Call it after ``issued`` was delivered (its left-out requesters put back).

    Args:
        state: the lighthouse state.
        before: the quorum issued before ``issued`` (None: there was none).
        issued: the quorum just issued.

    Returns:
        Their replica ids, sorted.
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

    Args:
        state: the lighthouse state to update.
        member: the waiting requester.
        joined_at: the join time to record (the server passes the current time).
    """
    state.participants[member.replica_id] = (joined_at, member)


def withdraw(state: LighthouseState, member: QuorumMember) -> bool:
    """Take back a request that nobody waits for any more (its caller gave up or went away).

    Only that very request is taken out: a newer request of the same replica stays.

    Args:
        state: the lighthouse state to update.
        member: the request, as it was joined.

    Returns:
        Whether it was still waiting.
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

    A missing heartbeat and an expired one mean the same (not healthy), so dropping entries
    older than the heartbeat timeout changes no decision; give ``config`` to have that checked.

    Args:
        state: the lighthouse state to prune.
        now: monotonic time in seconds.
        older_than_s: minimum age, in seconds, of the entries to drop (> 0).
        config: if given, ``older_than_s`` must be >= its heartbeat timeout.

    Returns:
        The forgotten replica ids, sorted.

    Raises:
        ValueError: ``older_than_s`` is not > 0, or is below ``config``'s heartbeat timeout.
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
