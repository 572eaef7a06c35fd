"""Every event the checker interleaves, as one successor function over the model's states.

An event is a tuple ``(kind, group, argument)`` (group -1 for the lighthouse and the clock).
:func:`successors` yields, for one state, each enabled event with the state it leads to, whether
it is a fault (spends the fault budget; excluded from the liveness paths), whether it is a
commit (progress for liveness) and the first invariant it breaks (invariants 1 to 3; liveness is
judged by the search on the whole graph).

Protocol events: ``ask``, ``tick``, ``advance`` (the clock; live groups with a session heartbeat),
``heal``, ``heal_fail`` (the source died, froze or left before the copy completed: the healer
keeps its old state), ``contribute``, ``complete``, ``fail`` (the allreduce waits on a member that
died, froze, or left without contributing; or a member that contributed died or froze),
``commit``, ``no`` (the vote of a group that doubts its standing), ``thaw``, ``reconnect``.
Fault events, each spending one of the fault budget: ``die``, ``error`` (a local error: vote
no), ``freeze``, ``restart``, ``restart_store``; ``rejoin`` (a dead group comes back as a new
one) is free, its death paid for it, but like the faults it is never part of a liveness path.
A group about to ask is slow by not being scheduled while the clock advances, within the busy
bound (:func:`_may_advance`); its other moves come before the clock moves on (``model.pace``).
"""

from __future__ import annotations

from collections.abc import Iterator

from tests.protocol.memory import LH_HBS, LH_PARTS, LH_PREV, LH_STORED, WALL
from tests.protocol.model import (
    ALIVE,
    ASK,
    AUX,
    CF,
    DEAD,
    DISC,
    DONE,
    DOUBT,
    FROZE,
    FROZEN,
    HEAL,
    HIST,
    IDLE,
    INC,
    LASTQ,
    LIFE,
    LINEAGE,
    OUT,
    PACE,
    PHASE,
    READY,
    SENT,
    SESS,
    STEP,
    URGENT,
    Model,
    Q,
    Violation,
    fresh_group,
    put,
)
from torchheal.coordination.plan import Participation
from torchheal.manager.machine import StepMachine

Event = tuple[str, int, object]
#: (event, next state or None when it broke an invariant, fault, commit, violation or None)
Successor = tuple[Event, "tuple | None", bool, bool, "str | None"]


def successors(m: Model, state: tuple) -> Iterator[Successor]:
    """Each enabled event of ``state`` and where it leads (see the module docstring)."""
    lh, groups, rounds_t, faults = state
    rounds = {q: frozenset(c) for q, c in rounds_t}
    ev, spare = m.ev, faults > 0
    for i, grp in enumerate(groups):
        life, phase = grp[LIFE], grp[PHASE]
        if life == ALIVE:
            if not grp[SESS]:
                yield _try(("reconnect", i, None), False, lambda i=i: _reconnect(m, state, i))
            elif phase == IDLE:
                yield _try(("ask", i, None), False, lambda i=i: _ask(m, state, i))
            if phase == HEAL:
                src = m.locate(groups, grp[AUX])
                if src is not None and src[LIFE] == ALIVE and _holds(src, grp[Q]):
                    yield _try(("heal", i, grp[AUX]), False, lambda i=i: _heal(m, state, i))
                if src is None or src[LIFE] == FROZEN or not _holds(src, grp[Q]):
                    yield _try(("heal_fail", i, grp[AUX]), False, lambda i=i: _fail(m, state, i))
            elif phase == READY:
                yield _try(("contribute", i, None), False, lambda i=i: _contribute(m, state, i))
            elif phase == SENT:
                complete, may_fail = m.collective(groups, rounds, i)
                if complete:
                    yield _try(("complete", i, None), False, lambda i=i: _complete(m, state, i))
                if may_fail:
                    yield _try(("fail", i, None), False, lambda i=i: _fail(m, state, i))
            elif phase == DONE:
                kind = "no" if grp[DOUBT] else "commit"
                yield _try((kind, i, None), False, lambda i=i: _vote(m, state, i))
                if "error" in ev and spare:
                    yield _try(("error", i, None), True, lambda i=i: _fail(m, state, i, True))
            if "freeze" in ev and spare:
                yield _try(("freeze", i, None), True, lambda i=i: _freeze(m, state, i))
        elif life == FROZEN:
            yield _try(("thaw", i, None), False, lambda i=i: _thaw(m, state, i))
        elif "rejoin" in ev:
            # Not a protocol move (liveness never counts on it), but free: a death paid for it.
            yield _try(("rejoin", i, None), True, lambda i=i: _rejoin(m, state, i))
        if life != DEAD and "die" in ev and spare:
            yield _try(("die", i, None), True, lambda i=i: _die(m, state, i))
    issued = _tick(m, state) if m.lh[lh][LH_PARTS] else None
    if issued is not None:
        yield issued
    else:  # the lighthouse ticks every unit: time moves on only when a tick issues nothing
        for d in m.o.advances_ms:
            if _may_advance(m, state, d):
                yield _try(("advance", -1, d), False, lambda d=d: _advance(m, state, d))
    for kind in ("restart", "restart_store"):
        if kind in ev and spare:
            yield _try((kind, -1, None), True, lambda k=kind: _restart(m, state, k))


def _try(event: Event, fault: bool, apply) -> Successor:
    try:
        nxt, commit = apply()
    except Violation as exc:
        return event, None, fault, False, str(exc)
    return event, nxt, fault, commit, None


def _holds(src: tuple, qref: int) -> bool:
    """Whether a heal source is still in quorum ``qref`` at its step, able to send its state."""
    return src[Q] == qref and src[PHASE] in (READY, SENT, DONE)


def _core_call(m: Model, ref: int, key: tuple, fn) -> int:
    """Run ``fn`` on the core's LighthouseState rebuilt from memory ``ref``; the new memory.

    The core's functions are pure: ``key`` names the call, and each is made once per memory.
    """
    cached = m.op_cache.get((ref, key))
    if cached is None:
        st = m.to_core(ref)
        fn(st)
        cached = m.op_cache[(ref, key)] = m.from_core(st, m.lh[ref][LH_STORED])
    return cached


def _groups(state: tuple) -> list:
    return list(state[1])


def _rounds(state: tuple) -> dict:
    return {q: frozenset(c) for q, c in state[2]}


def _ask(m: Model, state: tuple, i: int):
    grp = state[1][i]
    member = m.member(m.rid(i, grp[INC]), grp[STEP], grp[CF])
    if m.lineage:  # the quorum of its last commit, as a torchheal group's request says
        key = ("join", member, grp[LINEAGE])
        lh = _core_call(m, state[0], key, lambda st: m.core.join(st, member, 0.0, grp[LINEAGE]))
    else:
        lh = _core_call(m, state[0], ("join", member), lambda st: m.core.join(st, member, 0.0))
    groups = _groups(state)
    groups[i] = put(grp, phase=ASK, doubt=False)
    return m.finish(lh, groups, _rounds(state), state[3]), False


def _reconnect(m: Model, state: tuple, i: int):
    grp = state[1][i]
    rid = m.rid(i, grp[INC])

    def call(st) -> None:
        m.core.session_opened(st, rid, 0.0)
        if grp[LASTQ] is not None:
            m.core.restore(st, m.quorums[grp[LASTQ]], 0.0)

    lh = _core_call(m, state[0], ("open", rid, grp[LASTQ]), call)
    groups = _groups(state)
    groups[i] = put(grp, sess=True, disc=None)
    return m.finish(lh, groups, _rounds(state), state[3]), False


def _heal(m: Model, state: tuple, i: int):
    grp = state[1][i]
    src = m.locate(state[1], grp[AUX])
    groups = _groups(state)
    lineage = src[LINEAGE] if m.o.heal_takes_lineage else grp[LINEAGE]
    groups[i] = put(grp, phase=READY, step=src[STEP], hist=src[HIST], lineage=lineage, out=False)
    m.check_histories(tuple(groups))
    return m.finish(state[0], groups, _rounds(state), state[3]), False


def _fail(m: Model, state: tuple, i: int, fault: bool = False):
    """The step fails for group ``i`` (heal, collective, or a local error at the vote).

    Its commit failures become 1: the lighthouse only asks whether there are any (a new id),
    so 1 stands for any number (the Manager's ``max_retries`` is not modelled).
    """
    grp = state[1][i]
    groups = _groups(state)
    groups[i] = put(grp, phase=IDLE, q=None, aux=None, cf=1)
    return m.finish(state[0], groups, _rounds(state), state[3] - fault), False


def _contribute(m: Model, state: tuple, i: int):
    grp = state[1][i]
    rid = m.rid(i, grp[INC])
    rounds = _rounds(state)
    got = rounds.get(grp[Q], frozenset())
    for other, hist in sorted(got):
        if hist != grp[HIST] and 2 in m.o.invariants:
            raise Violation(
                f"invariant 2 (trains on the same history): {rid} contributes to quorum "
                f"{m.quorums[grp[Q]].quorum_id} with {m.render_hist(grp[HIST])} while {other} "
                f"contributed with {m.render_hist(hist)}"
            )
    rounds[grp[Q]] = got | {(rid, grp[HIST])}
    groups = _groups(state)
    groups[i] = put(grp, phase=SENT)
    return m.finish(state[0], groups, rounds, state[3]), False


def _complete(m: Model, state: tuple, i: int):
    grp = state[1][i]
    contributions = tuple(sorted(dict(state[2])[grp[Q]]))
    groups = _groups(state)
    groups[i] = put(grp, phase=DONE, aux=m.intern_content(contributions))
    return m.finish(state[0], groups, _rounds(state), state[3]), False


def _vote(m: Model, state: tuple, i: int):
    """The group votes and the real step machine decides (one rank: its ballot is the group's)."""
    grp = state[1][i]
    quorum = m.quorums[grp[Q]]
    machine = StepMachine(
        min_replica_size=m.o.min_replicas, max_retries=None, salvage=False, warmup=False
    )
    machine.step, machine.commit_failures = grp[STEP], grp[CF]
    machine.quorum_taken(
        Participation(0, len(quorum.participants)), healing=False, max_step=m.qinfo[grp[Q]][0]
    )
    if not machine.ballot(errored=bool(grp[DOUBT])).vote:
        return _fail(m, state, i)
    groups = _groups(state)
    commit = grp[STEP] < m.o.cap
    lineage = quorum.quorum_id
    if commit:
        machine.decided(True)
        hist = m.intern_hist((*m.hist[grp[HIST]], grp[AUX]))
        groups[i] = put(
            grp,
            phase=IDLE,
            q=None,
            aux=None,
            cf=machine.commit_failures,
            step=machine.step,
            hist=hist,
            lineage=lineage,
            out=False,
        )
        m.check_histories(tuple(groups))
    else:  # at the cap the run is over for this group: it takes part, commits nothing more
        groups[i] = put(grp, phase=IDLE, q=None, aux=None, cf=0, lineage=lineage)
    return m.finish(state[0], groups, _rounds(state), state[3]), commit


def _freeze(m: Model, state: tuple, i: int):
    groups = _groups(state)
    groups[i] = put(groups[i], life=FROZEN, froze=0)
    return m.finish(state[0], groups, _rounds(state), state[3] - 1), False


def _thaw(m: Model, state: tuple, i: int):
    grp = state[1][i]
    lh = state[0]
    if grp[SESS]:
        rid = m.rid(i, grp[INC])
        lh = _core_call(m, lh, ("beat", rid), lambda st: m.core.heartbeat(st, rid, 0.0))
    # Standing: a stall of the doubt limit since the group asked is doubted at its next vote.
    doubt = grp[DOUBT] or (grp[PHASE] != IDLE and -grp[FROZE] >= m.doubt_ms)
    groups = _groups(state)
    disc = None if grp[SESS] else 0
    groups[i] = put(grp, life=ALIVE, froze=None, doubt=doubt, disc=disc)
    m.check_histories(tuple(groups))
    return m.finish(lh, groups, _rounds(state), state[3]), False


def _die(m: Model, state: tuple, i: int):
    grp = state[1][i]
    lh = state[0]
    if grp[SESS]:
        rid = m.rid(i, grp[INC])
        lh = _core_call(m, lh, ("end", rid), lambda st: m.core.session_ended(st, rid))
    groups = _groups(state)
    groups[i] = put(grp, life=DEAD, sess=False, froze=None, disc=None)
    return m.finish(lh, groups, _rounds(state), state[3] - 1), False


def _rejoin(m: Model, state: tuple, i: int):
    inc = state[1][i][INC] + 1
    rid = m.rid(i, inc)
    lh = _core_call(
        m, state[0], ("open", rid, None), lambda st: m.core.session_opened(st, rid, 0.0)
    )
    groups = _groups(state)
    groups[i] = fresh_group(inc)
    return m.finish(lh, groups, _rounds(state), state[3]), False


def _tick(m: Model, state: tuple) -> Successor | None:
    """The lighthouse ticks; None when it issues nothing (the state does not change)."""
    issued = _lighthouse_tick(m, state[0])
    if issued is None:
        return None
    qref, lh, before, told = issued
    max_step, members = m.qinfo[qref]
    groups = _groups(state)
    for i, grp in enumerate(state[1]):
        if grp[LIFE] != DEAD and grp[PHASE] == ASK and m.rid(i, grp[INC]) in members:
            src = m.heal_source(qref, m.rid(i, grp[INC]))
            groups[i] = put(grp, phase=HEAL if src else READY, q=qref, aux=src, lastq=qref)
    if told and "lost_notices" not in m.ev:
        # Told that its quorum is over, a member left out aborts a step not yet completed.
        _abort(m, groups, before, told)
    event = ("tick", -1, qref)
    for i, grp in enumerate(state[1]):
        if grp[LIFE] == ALIVE and not grp[OUT] and grp[STEP] > max_step and 3 in m.o.invariants:
            broken = (
                f"invariant 3 (no step goes back): quorum {m.quorums[qref].quorum_id} is issued "
                f"at step {max_step} while {m.rid(i, grp[INC])} lives at step {grp[STEP]}"
            )
            return event, None, False, False, broken
    return event, m.finish(lh, groups, _rounds(state), state[3]), False, False, None


def _lighthouse_tick(m: Model, ref: int) -> tuple | None:
    """What one tick of the lighthouse in memory ``ref`` does (a function of it alone).

    Returns None when nothing is issued, else (the quorum, the memory after it, the quorum
    before it, the members of that one it left out alive and not asking: they are told).
    Requests left out are put back, as the server does.
    """
    if ref in m.tick_cache:
        return m.tick_cache[ref]
    st = m.to_core(ref)
    before = st.prev_quorum
    quorum, _reason = m.core.tick(st, m.config, 0.0, WALL)
    result = None
    if quorum is not None:
        qref = m.qref(quorum)
        members = m.qinfo[qref][1]
        for rid, _joined, key in m.lh[ref][LH_PARTS]:
            if rid not in members:
                m.core.requeue(st, m.member(*key), 0.0)
        told: frozenset[str] = frozenset()
        if before is not None:
            told = frozenset(m.core.left_out(st, before, quorum))
        before_ref = None if before is None else m.qref(before)
        result = (qref, m.from_core(st, qref), before_ref, told)
    m.tick_cache[ref] = result
    return result


def _may_advance(m: Model, state: tuple, d: int) -> bool:
    """Whether the clock may move by ``d`` ms: every bound the event families keep holds.

    No group has a move it makes at once (``URGENT``). The busy bound, unless "hang": the
    lighthouse never waits ``busy_bound_ms`` (counted from the earliest pending request) for a
    member of its last quorum that is not asking while it still sees it alive: a live group
    asks within that time, however slow, frozen or blocked it was. A frozen group past the
    heartbeat timeout (when "long_freeze" allows it) is not seen alive and not waited for.
    """
    ev, hb = m.ev, m.hb
    lh = m.lh[state[0]]
    parts, prev = lh[LH_PARTS], lh[LH_PREV]
    if parts and prev is not None and "hang" not in ev:
        waited = m.qinfo[prev][1]
        # From the earliest request, not the core's window start (its first request of a
        # member of the last quorum): that member may die, and the window then starts at the
        # earliest request of all, at once older.
        start = min(t for _, t, _ in parts)
        if d - start >= m.o.busy_bound_ms:
            asking = {rid for rid, _, _ in parts}
            seen = dict(lh[LH_HBS])
            for rid in waited:
                if rid in asking or m.locate(state[1], rid) is None:
                    continue
                if rid in seen and d - seen[rid] < hb:
                    return False
    for grp in state[1]:
        if grp[LIFE] == ALIVE:
            if grp[PACE] == URGENT:
                return False
            if grp[DISC] is not None and "slow_reconnect" not in ev and d - grp[DISC] >= hb:
                return False
        elif grp[LIFE] == FROZEN and d - grp[FROZE] >= hb and "long_freeze" not in ev:
            return False
    return True


def _advance(m: Model, state: tuple, d: int):
    lh = m.shift_lh(state[0], d)
    groups = _groups(state)
    beating = []
    hb = -m.hb
    for i, grp in enumerate(groups):
        if grp[LIFE] == DEAD:
            continue
        if grp[LIFE] == ALIVE and grp[SESS]:
            beating.append(m.rid(i, grp[INC]))
        froze, disc = grp[FROZE], grp[DISC]
        if froze is not None or disc is not None:
            groups[i] = put(
                grp,
                froze=None if froze is None else max(froze - d, hb),
                disc=None if disc is None else max(disc - d, hb),
            )

    def beat(st) -> None:
        for rid in beating:
            m.core.heartbeat(st, rid, 0.0)

    lh = _core_call(m, lh, ("beat", *beating), beat)
    seen = dict(m.lh[lh][LH_HBS])
    for i, grp in enumerate(groups):
        if grp[LIFE] == FROZEN or grp[DISC] is not None:
            # Its heartbeat expires: the lighthouse takes it for dead from now on.
            age = seen.get(m.rid(i, grp[INC]))
            if age is not None and -age >= m.hb and not grp[OUT]:
                groups[i] = put(grp, out=True)
    prev = m.lh[state[0]][LH_PREV]
    silent = any(g[LIFE] == FROZEN or g[DISC] is not None for g in groups)
    if prev is not None and silent and "lost_notices" not in m.ev:
        # The lighthouse tells the other members of its last quorum about a member whose
        # heartbeat just expired; they abort a step with it not yet completed.
        lost = _lost(m, lh) - _lost(m, state[0])
        if lost:
            members = set(m.qinfo[prev][1])
            _abort(m, groups, prev, members - lost)
    return m.finish(lh, groups, _rounds(state), state[3]), False


def _lost(m: Model, ref: int) -> set[str]:
    """The members of the last quorum the lighthouse in memory ``ref`` holds for lost."""
    if ref not in m.lost_cache:
        m.lost_cache[ref] = set(m.core.lost_members(m.to_core(ref), m.config, 0.0))
    return m.lost_cache[ref]


def _abort(m: Model, groups: list, qref: int, told: set[str]) -> None:
    """Groups ``told`` (by a notice) abort their step in ``qref`` if it has not completed."""
    for i, grp in enumerate(groups):
        if (
            grp[LIFE] != DEAD
            and grp[Q] == qref
            and grp[PHASE] in (HEAL, READY, SENT)
            and m.rid(i, grp[INC]) in told
        ):
            groups[i] = put(grp, phase=IDLE, q=None, aux=None, cf=1)


def _restart(m: Model, state: tuple, kind: str):
    """The lighthouse dies and starts again: sessions and pending requests die with it."""
    st = m.core.LighthouseState()
    stored = m.lh[state[0]][LH_STORED] if kind == "restart_store" else None
    if stored is not None:
        m.core.restore(st, m.quorums[stored], 0.0)
    lh = m.from_core(st, stored)
    groups = _groups(state)
    for i, grp in enumerate(groups):
        if grp[LIFE] == DEAD:
            continue
        asking = grp[PHASE] == ASK
        groups[i] = put(
            grp,
            sess=False,
            phase=IDLE if asking else grp[PHASE],
            disc=0 if grp[LIFE] == ALIVE else None,
        )
    return m.finish(lh, groups, _rounds(state), state[3] - 1), False
