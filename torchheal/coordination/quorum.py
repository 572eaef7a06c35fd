"""The lighthouse's quorum decision, as pure functions of its state and the time.

Every rule that decides *who is in the next quorum, and under which id* lives here (reference §4):
healthy replicas, the fast path, the ``min_replicas``/split-brain/straggler checks, ``shrink_only``
and when the id moves. The lighthouse server holds one :class:`LighthouseState` under a lock and
feeds it events and ticks (:func:`tick`); it never decides anything itself. No I/O, threads or
clock: ``now`` is monotonic seconds from the caller, ``wall`` the stamp put on issued quorums.

Reason strings match the reference byte for byte because operators and tests read them (the
dashboard shows the reason of a fresh :func:`quorum_compute`).
"""

from __future__ import annotations

from dataclasses import replace

from torchheal.coordination.quorum_state import (
    GAVE_UP_REASON,
    LighthouseConfig,
    LighthouseState,
    forget_stale_heartbeats,
    heartbeat,
    join,
    left_out,
    lost_members,
    requeue,
    restore,
    session_ended,
    session_opened,
    superseded,
    withdraw,
)
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


def quorum_compute(
    state: LighthouseState, config: LighthouseConfig, now: float
) -> tuple[list[QuorumMember] | None, str]:
    """Decide whether a quorum can be issued now, and who is in it (reference §4).

    Returns ``(candidates sorted by replica_id, reason)``, or ``(None, reason)`` when not ready;
    does not change ``state``.
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

    # As they would be issued: a superseded member's own step must not hide a live holder.
    issued = _healing_if_superseded(state, candidates)
    holders = _live_holders_ahead(prev, issued, healthy_replicas, healthy_participants)
    if holders:
        # Its stragglers include the holders, so the window's start is defined.
        bound_s = _wait_for_alive_s(state, holders, config)
        if now - _straggler_window_start(prev, healthy_participants) < bound_s - _EPSILON_S:
            behind = max((member.step for member in issued), default=0)
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
        # Deliberate difference: the reference would issue an empty quorum here (all filtered
        # out by shrink_only); we wait, so prev_quorum is never empty.
        return None, (
            f"New quorum not ready, no candidates left after shrink_only filtering {metadata}"
        )

    return candidates, f"Valid quorum found {metadata}"


_EPSILON_S = 1e-9

#: How many of the first member's steps a late member known to be alive is waited for (see
#: :func:`_straggler_grace_s`); one was too few on a busy host (docs/failures.md).
STRAGGLER_GRACE_STEPS: float = 2.0


#: How many of the latest steps :attr:`LighthouseState.redone` remembers. A group further
#: behind than that heals anyway.
REDONE_KEPT: int = 4096

#: How long a live member of the last quorum that may have committed a step the candidates
#: would train again is waited for (see :func:`_live_holders_ahead`). Bounded so a hung training
#: thread cannot stop the job; 60 s is the reference's default quorum and collective timeout.
LIVE_HOLDER_WAIT_S: float = 60.0


def _straggler_window_start(
    prev: Quorum | None, healthy_participants: dict[str, tuple[float, QuorumMember]]
) -> float:
    """When the wait for stragglers began: the first request of a member of the last quorum.

    Deliberate difference from the reference (which counts from any participant's request), so
    that a group left out of the last quorum does not make groups take turns instead of training
    together (docs/failures.md). With no member of the last quorum asking, every requester counts.
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

    Deliberate difference from the reference: dropping a member that is alive costs a heal and
    two rebuilds, far more than waiting a fraction of a step. A member that healed in the last
    quorum (late by design) or has a live session (merely slow) is waited for
    :data:`STRAGGLER_GRACE_STEPS` times the first member's last step; reference peers keep the
    join timeout, since for them late and dead look the same.
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

    Deliberate difference from the reference: such a member, alive but busy, may have committed
    that step, and training it again would silently fork the groups' weights (docs/failures.md).
    :func:`quorum_compute` bounds the wait; a member the lighthouse knows is gone is not waited for.
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

    The id moves when the membership changed or any member reports failed commits. A
    lighthouse that records each quorum proposes, saves, then calls :func:`issue`, so a quorum
    that could not be saved leaves the state as it was. Returns ``(quorum or None, reason)``.
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

    The member's step is issued one below the step it can heal to, so the recovery plan heals
    it and its superseded commit is dropped.
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

    ``participants`` is cleared, so every member must ask again for the next round.
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

    Returns ``(quorum, reason)`` if one was issued, else ``(None, reason)``.
    """
    quorum, reason = propose(state, config, now, wall)
    if quorum is not None:
        issue(state, quorum, now)
    return quorum, reason
