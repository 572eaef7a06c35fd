"""The lighthouse's quorum decision, as pure functions of its state and the time.

Every rule that decides *who is in the next quorum, and under which id* lives here (reference §4):
which replicas count as healthy, the fast path that keeps a stable membership, the
``min_replicas``/split-brain/straggler checks, ``shrink_only`` filtering and when the quorum id
moves. The lighthouse server holds one :class:`LighthouseState` under a lock and feeds it
requests (:func:`join`), heartbeats (:func:`heartbeat`), the opening and end of torchheal
sessions (:func:`session_opened`, :func:`session_ended`), what it learns of quorums issued
before it (re)started (:func:`restore`) and ticks (:func:`tick`); it never decides anything
itself. Nothing here does I/O, starts threads or reads a clock: ``now`` is a monotonic
time in float seconds supplied by the caller, ``wall`` the wall-clock stamp put on issued quorums.

Reason strings match the reference byte for byte because operators and tests read them (the
dashboard shows the reason of a fresh :func:`quorum_compute`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

__all__ = [
    "GAVE_UP_REASON",
    "LighthouseConfig",
    "LighthouseState",
    "forget_stale_heartbeats",
    "heartbeat",
    "issue",
    "join",
    "left_out",
    "lost_members",
    "propose",
    "quorum_compute",
    "requeue",
    "restore",
    "session_ended",
    "session_opened",
    "superseded",
    "tick",
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
        lineages: replica_id -> the id of the quorum in which the group last committed, as its
            latest request said (torchheal groups; 0: not said).
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
    the reference (the newest step/commit_failures are what the replica reports now).

    Args:
        state: the lighthouse state to update.
        member: the requester as it presents itself.
        now: monotonic time in seconds.
        lineage: the id of the quorum in which the group last committed (its session's
            request says it; 0: unknown, as for a reference peer, which is never judged).
    """
    state.heartbeats[member.replica_id] = now
    state.participants[member.replica_id] = (now, member)
    state.lineages[member.replica_id] = lineage


def superseded(state: LighthouseState, member: QuorumMember) -> bool:
    """Whether ``member`` holds a commit that a later quorum trained again without it.

    A group that committed step ``s`` in quorum ``q`` and was then declared lost (frozen past
    the heartbeat timeout: a host stall, a pause that held the interpreter) may come back at
    step ``s + 1`` after the others trained step ``s`` again in a newer quorum. Its step says
    nothing wrong, and at an equal step nobody would heal: the groups would hold different
    weights for the rest of the job (issue 40). Its history is known superseded when a quorum
    newer than ``q`` was issued to train step ``s``. Only torchheal groups say in which quorum
    they committed; a reference peer is never judged.
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

    The end of the stream is the lighthouse's own evidence (the group's process died, or it left
    and said so), never a peer's claim, so the split-brain guard stays sound: a group that is in
    fact alive (a network blip) opens a new session, heartbeats again and rejoins at the next
    round, healing if it fell behind. Its pending request, if any, is dropped.

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

    A restarted lighthouse starts from nothing, while the groups still hold the quorum they got
    from its previous life (each torchheal group reports its last one in its session's Hello; a
    state file or etcd remembers it for groups that do not). Two rules keep a restart safe:

    * **Ids never go backwards, and never repeat.** The next issued quorum takes an id above
      every reported one, even with the same members: a group only rebuilds its process group
      when the id changes, so an id it already holds must never name a different quorum.
    * **The restored quorum is waited for as the last quorum would have been.** Its members
      that have not come back yet count as heard from now, so the first quorum after the
      restart is not issued to the first group that reconnects while the others are still
      reopening their sessions: the split-brain guard and the straggler wait treat them as
      they would have without the restart, until their heartbeat timeout (a member that died
      with the lighthouse is then dropped, as it would have been).

    A quorum with no members carries only an id: a group that restarted, with its lighthouse,
    reports the last id its replica group's store records (the store still holds the process
    groups' keys under ``/torchft/{id}/``, so no id it used may name a new quorum); only the
    id moves.

    A quorum older than the latest known one changes nothing (every ordinary reconnection
    reports one): the lighthouse never adopts an older past. A newer one arriving after this
    lighthouse already issued quorums (a group that was slow to reconnect) only moves the id.

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
#: process group (``SessionRequest.gave_up``) begins, for the logs; the notice says so in its
#: ``gave_up`` field. The group is alive: its own ranks abort their group for that quorum like
#: any other rank, and its vote needs no doubt (the rank that gave up votes no).
GAVE_UP_REASON = "gave up building its process group"


def left_out(state: LighthouseState, before: Quorum | None, issued: Quorum) -> list[str]:
    """Members of ``before`` that ``issued`` left out while they are alive and not asking.

    Such a member is still at work in ``before`` (a long step, or a process-group build that
    waits for a peer's address), but its peers have left that quorum for ``issued``: nothing it
    waits on there will ever complete, and without a word it would wait for its own timeout. A
    member is alive while its torchheal session lasts; one that is asking (a request the issue
    put back) already left ``before`` and will be answered the next quorum. A reference peer
    has no session and is never told (the reference tells nobody anything).

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

    The server calls this for each waiting request that was not in the quorum it received
    (reference §4 step 3: "not in quorum, retrying"); the request keeps waiting for the next one.

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

    The reference never removes heartbeats, so a long-lived lighthouse grows without bound as
    replicas come and go. A missing heartbeat and an expired one mean the same thing to
    :func:`quorum_compute` (not healthy), so dropping entries older than the heartbeat timeout
    changes no decision. The caller must therefore pass ``older_than_s`` >= the heartbeat
    timeout; give ``config`` to have that checked.

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


def quorum_compute(
    state: LighthouseState, config: LighthouseConfig, now: float
) -> tuple[list[QuorumMember] | None, str]:
    """Decide whether a quorum can be issued now, and who is in it (reference §4).

    Does not change ``state``.

    Args:
        state: the lighthouse state.
        config: the quorum options.
        now: monotonic time in seconds.

    Returns:
        ``(candidates sorted by replica_id, reason)`` when a quorum is ready, else
        ``(None, reason)``.
    """
    heartbeat_timeout_s = config.heartbeat_timeout_ms / 1000.0
    healthy_replicas = {
        rid for rid, seen in state.heartbeats.items() if now - seen < heartbeat_timeout_s
    }
    healthy_participants = {
        rid: entry for rid, entry in state.participants.items() if rid in healthy_replicas
    }
    # Python's str order is code-point order, which equals the reference's UTF-8 byte order.
    candidates = [healthy_participants[rid][1] for rid in sorted(healthy_participants)]
    shrink_only = any(member.shrink_only for _, member in healthy_participants.values())

    metadata = (
        f"[{len(healthy_participants)}/{len(state.participants)} participants healthy]"
        f"[{len(healthy_replicas)} heartbeating][shrink_only={str(shrink_only).lower()}]"
    )

    prev = state.prev_quorum
    if prev is not None:
        prev_ids = {member.replica_id for member in prev.participants}
        if shrink_only:
            candidates = [member for member in candidates if member.replica_id in prev_ids]
        # Fast path: the whole previous membership is back, so nobody is lost and no safety
        # check is needed; requesters that are new join it at once (growth never waits).
        if prev_ids <= healthy_participants.keys():
            return candidates, f"Fast quorum found! {metadata}"

    if len(healthy_participants) < config.min_replicas:
        return None, (
            f"New quorum not ready, only have {len(healthy_participants)} participants, "
            f"need min_replicas {config.min_replicas} {metadata}"
        )

    # Split-brain guard: a quorum needs a strict majority of the replicas that are alive.
    if len(healthy_participants) <= len(healthy_replicas) // 2:
        return None, (
            f"New quorum not ready, only have {len(healthy_participants)} participants, "
            f"need at least half of {len(healthy_replicas)} healthy workers {metadata}"
        )

    # healthy_participants is a subset of healthy_replicas, so comparing sizes is enough.
    stragglers = len(healthy_replicas) - len(healthy_participants)
    if stragglers > 0:
        first_joined = _straggler_window_start(prev, healthy_participants)
        window_s = config.join_timeout_ms / 1000.0
        grace_s = _straggler_grace_s(state, healthy_replicas, healthy_participants, first_joined)
        # Within a nanosecond counts as elapsed: seconds are floats, and a wait of exactly the
        # join timeout must not hang on the rounding of a subtraction (1.45 - 1.35 < 0.1).
        if now - first_joined < max(window_s, grace_s) - _EPSILON_S:
            extended = (
                f"(extended to {grace_s * 1000:.0f} ms for members known to be alive) "
                if grace_s > window_s
                else ""
            )
            return None, (
                f"Valid quorum with {len(healthy_participants)} participants, waiting for "
                f"{stragglers} healthy but not participating stragglers due to join timeout "
                f"{extended}{metadata}"
            )

    holders = _live_holders_ahead(prev, candidates, healthy_replicas, healthy_participants)
    if holders:
        # Its stragglers include the holders, so the window's start is defined.
        bound_s = _wait_for_alive_s(state, holders, config)
        if now - _straggler_window_start(prev, healthy_participants) < bound_s - _EPSILON_S:
            behind = max((member.step for member in candidates), default=0)
            prev_max = max(m.step for m in prev.participants)
            if behind < prev_max:
                return None, (
                    f"New quorum not ready, its step {behind} is behind step {prev_max} of "
                    f"{', '.join(holders)}, alive but not asking yet (waited for up to "
                    f"{bound_s:.0f} s) {metadata}"
                )
            return None, (
                f"New quorum not ready, it would redo step {behind}, which "
                f"{', '.join(holders)} may have committed (alive, not asking yet; waited for "
                f"up to {bound_s:.0f} s) {metadata}"
            )

    lone = [
        m.replica_id
        for m in candidates
        if superseded(state, m) and not _sources(state, candidates, m)
    ]
    others = sorted(healthy_replicas - healthy_participants.keys())
    if lone and others:
        # A group whose history was superseded must heal from one that holds the current
        # one; if none asks yet, the quorum waits for the others (bounded as for holders).
        bound_s = _wait_for_alive_s(state, others, config)
        if now - _straggler_window_start(prev, healthy_participants) < bound_s - _EPSILON_S:
            return None, (
                f"New quorum not ready, {', '.join(lone)} committed a step that a later quorum "
                f"trained again; waiting for {', '.join(others)} to heal from (waited for up "
                f"to {bound_s:.0f} s) {metadata}"
            )

    if not candidates:
        # Deliberate difference: only reachable when shrink_only filtered out every healthy
        # requester. The reference would issue an empty quorum (no one receives it) and then
        # loop on a vacuous fast path; we wait instead, so prev_quorum is never empty.
        return None, (
            f"New quorum not ready, no candidates left after shrink_only filtering {metadata}"
        )

    return candidates, f"Valid quorum found {metadata}"


_EPSILON_S = 1e-9

#: How many of the first member's steps a late member known to be alive is waited for (see
#: :func:`_straggler_grace_s`). One was measured too few on a busy host: with 3-4 groups on 2
#: cores, a group's step now and then took 2-2.5x the fastest one's (the scheduler, not the
#: group), it was dropped, and the drop cost two process-group rebuilds and a heal (6% of the
#: run's commits without it). Two covers that, and a frozen member costs one more step once.
STRAGGLER_GRACE_STEPS: float = 2.0


#: How many of the latest steps :attr:`LighthouseState.redone` remembers. A group further
#: behind than that heals anyway.
REDONE_KEPT: int = 4096

#: How long a member of the last quorum that may have committed a step the candidates would
#: train again is waited for while its torchheal session lasts (see :func:`_live_holders_ahead`):
#: the session proves it alive, so it is merely busy. Bounded, so that a training thread that
#: hangs while its session lives cannot stop the job; 60 s is the reference's default quorum and
#: collective timeout, past which the waiting groups' own requests fail anyway. Members without a
#: session are waited for up to the heartbeat timeout.
LIVE_HOLDER_WAIT_S: float = 60.0


def _straggler_window_start(
    prev: Quorum | None, healthy_participants: dict[str, tuple[float, QuorumMember]]
) -> float:
    """When the wait for stragglers began: the first request of a member of the last quorum.

    Deliberate difference from the reference, which counts from the earliest request of any
    participant. A group that was left out of the last quorum (or is new) asked long before
    the members of that quorum come back from their step; counting from its request means the
    window has already expired when the first member returns, so the next quorum is issued
    without the last member to arrive, which is then left out in its turn: groups take turns
    instead of training together. Members of the last quorum return together from a step they
    took together, so their first request is when the wait for the rest of them should begin.
    With no member of the last quorum asking yet (or no last quorum), every requester counts.
    """
    prev_ids = {m.replica_id for m in prev.participants} if prev is not None else set()
    joins = [joined for rid, (joined, _) in healthy_participants.items() if rid in prev_ids]
    if not joins:
        joins = [joined for joined, _ in healthy_participants.values()]
    return min(joins)


def _straggler_grace_s(
    state: LighthouseState,
    healthy_replicas: set[str],
    healthy_participants: dict[str, tuple[float, QuorumMember]],
    first_joined: float,
) -> float:
    """How long to wait for a late member of the last quorum known to be alive (0.0: none).

    Deliberate difference from the reference, whose join timeout (100 ms by default) drops any
    member that comes back later than that, however short the drop makes the job's life: the
    member heals in the next round (a transfer everyone waits for, and a reconfiguration
    twice), so dropping a member that is alive costs far more than waiting a fraction of a step
    for it. Two kinds of members are waited for :data:`STRAGGLER_GRACE_STEPS` times as long as
    the last step took the first member to come back (from the quorum's issue to its next
    request), which scales with the step and stays bounded (a member that never comes back is
    dropped two steps later):

    * a member that healed in the last quorum: it loads the received state on its training
      thread after the round's allreduce, and its first step on new tensors is slower, so it
      is late by design; dropped, it would heal again next round and be late again forever;
    * a member with a live torchheal session: the lighthouse knows it is alive (its death ends
      the stream at once, so a dead member is not waited for at all), so it is merely slow
      this step (a busy host, a pause). Members without a session (reference peers) keep the
      reference's join timeout: for them, late and dead look the same until the heartbeat
      timeout.
    """
    prev = state.prev_quorum
    if prev is None or state.prev_quorum_at is None:
        return 0.0
    known_alive = _healed_in(prev) | state.sessions
    waited_for = {
        m.replica_id
        for m in prev.participants
        if m.replica_id in known_alive
        and m.replica_id in healthy_replicas
        and m.replica_id not in healthy_participants
    }
    if not waited_for:
        return 0.0
    return STRAGGLER_GRACE_STEPS * max(0.0, first_joined - state.prev_quorum_at)


def _live_holders_ahead(
    prev: Quorum | None,
    candidates: list[QuorumMember],
    healthy_replicas: set[str],
    healthy_participants: dict[str, tuple[float, QuorumMember]],
) -> list[str]:
    """Members of the last quorum that may hold a step the candidates would train again (sorted).

    Deliberate difference from the reference, which issues the quorum of whoever asks once the
    join timeout has passed. A member of the last quorum that is alive but not asking may have
    committed that quorum's step: its collectives completed while the others failed theirs, and
    it is busy (an eval, a checkpoint save, a process-group build) before it asks again. Unless
    a candidate is past that step, the new quorum would commit the step a second time with other
    contents, and the member would come back level with the others or ahead of them: either its
    commit is silently lost (it heals over to the older history) or, at an equal step, nobody
    heals and the groups hold different weights for the rest of the job (issue 40). So every
    such member is waited for; :func:`quorum_compute` bounds the wait. A member whose session
    ended or whose heartbeat expired is not waited for: the lighthouse's evidence says its
    state died with it.
    """
    if prev is None or not prev.participants:
        return []
    prev_max = max(member.step for member in prev.participants)
    if max((member.step for member in candidates), default=0) > prev_max:
        return []
    return sorted(
        member.replica_id
        for member in prev.participants
        if member.replica_id in healthy_replicas and member.replica_id not in healthy_participants
    )


def _healed_in(quorum: Quorum) -> set[str]:
    """Members that received the state of a peer in ``quorum`` (by the recovery plan's rule).

    Members behind the quorum's highest step heal. At step 0 every member but one may heal
    (``init_sync``, a per-manager choice the lighthouse does not see), so all count.
    """
    steps = {m.replica_id: m.step for m in quorum.participants}
    max_step = max(steps.values(), default=0)
    if max_step == 0 and len(steps) > 1:
        return set(steps)
    return {rid for rid, step in steps.items() if step < max_step}


def propose(
    state: LighthouseState, config: LighthouseConfig, now: float, wall: Timestamp
) -> tuple[Quorum | None, str]:
    """The quorum :func:`tick` would issue now, with the id it would take; changes nothing.

    The id moves when the membership (the ordered replica ids) changed or any member reports
    failed commits. A lighthouse that records each quorum before delivering it proposes,
    saves, and only then calls :func:`issue`: a quorum that could not be saved leaves the state
    as it was (its requests keep waiting, no id is spent, the last quorum is still the one the
    groups hold), so notices and the wait for late members keep speaking of quorums that exist.

    Args:
        state: the lighthouse state (not changed).
        config: the quorum options.
        now: monotonic time in seconds.
        wall: wall-clock time stamped on the quorum.

    Returns:
        ``(quorum, reason)`` if one is ready, else ``(None, reason)``.
    """
    candidates, reason = quorum_compute(state, config, now)
    if candidates is None:
        return None, reason
    prev = state.prev_quorum
    new_ids = [member.replica_id for member in candidates]
    quorum_id = state.quorum_id
    if state.fresh_id:
        # Quorums this lighthouse did not issue may use ids up to quorum_id (see restore).
        quorum_id += 1
    elif prev is None or new_ids != [member.replica_id for member in prev.participants]:
        quorum_id += 1
    elif any(member.commit_failures > 0 for member in candidates):
        # Same members, but someone could not commit: a fresh id makes every group rebuild its
        # process group instead of reusing one that may be broken.
        quorum_id += 1
    members = tuple(_healing_if_superseded(state, candidates))
    return Quorum(quorum_id=quorum_id, participants=members, created=wall), reason


def _wait_for_alive_s(state: LighthouseState, waited: list[str], config: LighthouseConfig) -> float:
    """How long, from the round's start, members known alive but not asking are waited for.

    A member with a live session is surely alive: it is waited for longer
    (:data:`LIVE_HOLDER_WAIT_S`) than one that only heartbeats (a reference peer, or a member
    whose session is reopening), which is waited for up to the heartbeat timeout.
    """
    heartbeat_timeout_s = config.heartbeat_timeout_ms / 1000.0
    if all(rid in state.sessions for rid in waited):
        return max(LIVE_HOLDER_WAIT_S, heartbeat_timeout_s)
    return heartbeat_timeout_s


def _sources(
    state: LighthouseState, candidates: list[QuorumMember], member: QuorumMember
) -> list[QuorumMember]:
    """Candidates a superseded ``member`` can heal from: not superseded, and holding at least
    the step before its commit (the state the group held in common before it committed)."""
    return [
        m
        for m in candidates
        if m.step >= member.step - 1 and m is not member and not superseded(state, m)
    ]


def _healing_if_superseded(
    state: LighthouseState, candidates: list[QuorumMember]
) -> list[QuorumMember]:
    """The candidates as issued: a superseded member with a source is issued below it.

    The recovery plan heals a member whose step in the quorum is below the quorum's highest
    step, so the member's step is issued one below the step it can heal to from its sources
    (its own, or the sources' highest if lower): it receives the current history and its
    superseded commit is dropped. Its request is otherwise issued as it came.
    """
    issued = []
    for member in candidates:
        sources = _sources(state, candidates, member) if superseded(state, member) else []
        if sources:
            target = min(member.step, max(m.step for m in sources))
            member = replace(member, step=target - 1)
        issued.append(member)
    return issued


def issue(state: LighthouseState, quorum: Quorum, now: float) -> None:
    """Record ``quorum`` (from :func:`propose`) as issued at ``now``.

    It becomes the last quorum and its id the latest; ``participants`` is cleared, so every
    member must ask again for the next round.

    Args:
        state: the lighthouse state to update.
        quorum: the proposed quorum, delivered now.
        now: monotonic time in seconds.
    """
    state.quorum_id = quorum.quorum_id
    state.prev_quorum = quorum
    state.prev_quorum_at = now
    if quorum.participants:
        state.redone[max(m.step for m in quorum.participants)] = quorum.quorum_id
        if len(state.redone) > REDONE_KEPT:
            del state.redone[min(state.redone)]
    state.restored = False
    state.fresh_id = False
    state.participants.clear()


def tick(
    state: LighthouseState, config: LighthouseConfig, now: float, wall: Timestamp
) -> tuple[Quorum | None, str]:
    """Run one lighthouse tick: issue a quorum if one is ready (:func:`propose`, :func:`issue`).

    Args:
        state: the lighthouse state to update.
        config: the quorum options.
        now: monotonic time in seconds.
        wall: wall-clock time stamped on an issued quorum.

    Returns:
        ``(quorum, reason)`` if one was issued, else ``(None, reason)``.
    """
    quorum, reason = propose(state, config, now, wall)
    if quorum is not None:
        issue(state, quorum, now)
    return quorum, reason
