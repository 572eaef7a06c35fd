"""The world the interleaving checker explores: the real lighthouse core and N abstract groups.

Real: every lighthouse decision. Each event that reaches the lighthouse rebuilds a
``LighthouseState`` of the quorum module under test (``memory.py``) and calls its ``join``,
``heartbeat``, ``session_opened``, ``session_ended``, ``requeue``, ``restore``, ``tick``,
``left_out`` and ``lost_members``, as the scenario driver ``tests/coordination/test_scenarios.py``
does; who heals from whom is the real ``plan.compute_quorum_results``, the standing limit the
real ``standing.limit_for``.

Abstract: each replica group is one tuple (life, session, step, history, commit failures,
phase, lineage, ...), ruled close to what torchheal's Manager does: it asks at its step (with
the id of the quorum of its last commit, its lineage, where the core takes one); in a quorum it
heals if the plan says so (copying its source's step and history; a source that died, froze or
left makes the heal fail and the healer keeps its state), contributes to the step's allreduce,
which completes once every member contributed, and votes: it commits (step + 1, the step's
content appended to its history, lineage = that quorum) unless it had a local error or doubts
its standing (frozen for the standing limit since it asked); any failure sends it back to ask
at the same step. A commit's content is the set of contributions it averaged, each a (replica
id, history) pair: two commits of a step differ when their contributors or their bases do.
The lighthouse's notices act as the Manager's do: a member whose heartbeat expires makes the
other members of the last quorum abort a step not yet completed; a member left out of a new
quorum while alive and not asking aborts its own.

Time: integer milliseconds relative to ``now``, which is 0 in every stored state; the clock
moves by the join timeout, the unit. Bounds are scaled so that each is a few units away (join
timeout 1, standing limit 2, heartbeat timeout 3, live holder wait 4: the real order; the checked
copy's ``LIVE_HOLDER_WAIT_S`` is set to it). Times are clamped where the core cannot tell older
ones apart (heartbeats and frozen or cut-off times at the heartbeat timeout); join and issue
times at a horizon past every bound; before a round's first request, the last issue time at
``step_time_cap_ms`` (a longer step gives the same straggler grace: this only shortens a
wait for stragglers, never the holder rule's). A group is slow only before it asks: its other
moves are made before the clock moves on (a commit held back is a commit made first and kept
to itself); the lighthouse ticks before the clock moves on.

Not modelled: the ranks within a group (a group is one rank), the time a step's compute takes
(so the window of the holder wait and a holder's commit start together), asynchronous quorums
and healing beside the collectives, spares, ``shrink_only``, withdrawn requests, torn replicas
(a failed heal keeps the old state: bug 2 is out of reach), a group's store of quorum ids
(bug 3), the lighthouse's write-ahead save (bug 4), ``max_retries``, and two issues of the same
quorum value (same id, members and steps), which count as one allreduce.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType

from tests.protocol.memory import Memory
from torchheal.coordination.plan import compute_quorum_results
from torchheal.coordination.standing import limit_for

# A group: a tuple indexed by these fields.
LIFE, SESS, STEP, HIST, CF, PHASE, Q, AUX, DOUBT, PACE, FROZE, DISC, LASTQ, INC, LINEAGE, OUT = (
    range(16)
)
ALIVE, FROZEN, DEAD = 0, 1, 2
IDLE, ASK, HEAL, READY, SENT, DONE = range(6)
PHASE_NAMES = ("idle", "asking", "healing", "ready", "sent", "done")
IN_STEP = (HEAL, READY, SENT, DONE)
WAITING, SLOW, URGENT = range(3)

#: Event families. Protocol events (ask, tick, clock advances, heal, contribute, complete, a
#: collective failing on a member that is gone, vote, thaw, reconnect) are always on.
EVENT_FAMILIES = {
    "die": "a group dies at any point (its session ends)",
    "error": "a group has a local error: it votes no though its collective completed",
    "freeze": "a group freezes (no heartbeats, session open) for less than the heartbeat timeout",
    "long_freeze": "a group stays frozen past the heartbeat timeout (the lighthouse drops it)",
    "hang": "a live group stays busy past the busy bound (LIVE_HOLDER_WAIT_S)",
    "slow_reconnect": "after a lighthouse restart a live group reconnects past the timeout",
    "lost_notices": "the lighthouse's notices (a member lost, a quorum superseded) may never arrive",
    "restart": "the lighthouse restarts without its store",
    "restart_store": "the lighthouse restarts and reloads the last quorum from its store",
    "rejoin": "a dead group comes back as a new group (new replica id) at step 0",
}


@dataclass(frozen=True)
class Options:
    """The size and the rules of one exploration.

    Time is scaled down so that every bound of the core is a few clock advances away (states
    differ by their timers, so real seconds would make far too many): the join timeout is the
    unit, the heartbeat timeout 3 units (the standing limit, the larger of half of it and two
    heartbeat intervals, 2) and the live holder wait 4 (the module's ``LIVE_HOLDER_WAIT_S`` is
    set to it in the checked copy). The order of the bounds, join timeout < standing limit <
    heartbeat timeout < live holder wait, is the real one; the straggler grace (twice a step)
    falls anywhere between, as it does for real.

    Args:
        groups: how many replica groups (named a, b, c, ...; replica id = name + incarnation).
        cap: the last step: a group at ``cap`` goes on taking part but commits nothing more.
        min_replicas: the lighthouse's ``min_replicas``.
        faults: how many fault events one path may hold (deaths, errors, freezes, restarts).
        max_quorum_id: states where the lighthouse's quorum id is above this are not expanded
            (a safety net: ids are renumbered, so it is not reached at the sizes used).
        advances_ms: the clock advances explored.
        join_timeout_ms: the lighthouse's join timeout.
        heartbeat_timeout_ms: the lighthouse's heartbeat timeout.
        heartbeat_interval_ms: the groups' heartbeat interval (for the standing limit).
        live_holder_wait_ms: ``LIVE_HOLDER_WAIT_S`` in the checked copy, and the busy bound
            (``events._may_advance``), unless "hang" is on (None: leave the module's value; the
            busy bound is then 60 s).
        step_time_cap_ms: a step (from a quorum's issue to its first request) longer than this
            counts as this long (it only sets the straggler grace).
        init_sync: the Manager's ``init_sync`` (at step 0 all heal from the primary).
        lineage: groups say in which quorum they last committed, where the core takes it
            (torchheal sessions; False: as reference peers, which say nothing).
        heal_takes_lineage: a group that heals takes its source's lineage (the Manager reports
            the quorum it healed in, ``ManagerServer.healed``, which is never older; False: it
            keeps its own until it commits, as before that report).
        events: the event families on (``EVENT_FAMILIES``).
        invariants: which invariants are checked (1 to 4; leaving one out lets the search go
            on to what a violation leads to).
    """

    groups: int = 3
    cap: int = 3
    min_replicas: int = 1
    faults: int = 2
    max_quorum_id: int = 12
    advances_ms: tuple[int, ...] = (100,)
    join_timeout_ms: int = 100
    heartbeat_timeout_ms: int = 300
    heartbeat_interval_ms: int = 100
    live_holder_wait_ms: int | None = 400
    step_time_cap_ms: int = 200
    init_sync: bool = True
    lineage: bool = True
    heal_takes_lineage: bool = True
    events: frozenset[str] = frozenset()
    invariants: frozenset[int] = frozenset({1, 2, 3, 4})

    @property
    def busy_bound_ms(self) -> int:
        return 60_000 if self.live_holder_wait_ms is None else self.live_holder_wait_ms

    @property
    def horizon_ms(self) -> int:
        """Join and issue times older than this are clamped (see the module docstring)."""
        longest = max(self.busy_bound_ms, self.heartbeat_timeout_ms, 2 * self.step_time_cap_ms)
        return longest + self.join_timeout_ms

    def validate(self) -> None:
        """Raise ``ValueError`` on an unknown event family or a size that makes no sense."""
        unknown = set(self.events) - EVENT_FAMILIES.keys()
        if unknown:
            raise ValueError(f"unknown event families {sorted(unknown)}")
        if not 1 <= self.groups <= 26 or self.cap < 1 or self.faults < 0:
            raise ValueError(f"bad size: {self}")


class Violation(Exception):
    """An invariant failed in the state an event led to."""


class Model(Memory):
    """Successor function, invariants and rendering over plain, hashable states.

    A state is ``(lighthouse, groups, rounds, faults_left)``: ``lighthouse`` the interned index
    of the lighthouse's memory, ``groups`` a tuple of group tuples, ``rounds`` the contributions
    received so far by each quorum's allreduce, ``faults_left`` what is left of the fault budget.

    Args:
        options: the size and event families.
        core: the quorum module under test (``torchheal.coordination.quorum`` or a patched copy).
    """

    def __init__(self, options: Options, core: ModuleType) -> None:
        options.validate()
        super().__init__(
            core, options.heartbeat_timeout_ms, options.horizon_ms, options.step_time_cap_ms
        )
        self.o = options
        if options.live_holder_wait_ms is not None and hasattr(core, "LIVE_HOLDER_WAIT_S"):
            core.LIVE_HOLDER_WAIT_S = options.live_holder_wait_ms / 1000
        self.config = core.LighthouseConfig(
            min_replicas=options.min_replicas,
            join_timeout_ms=options.join_timeout_ms,
            heartbeat_timeout_ms=options.heartbeat_timeout_ms,
        )
        self.config.validate()
        self.doubt_ms = round(
            1000
            * limit_for(options.heartbeat_timeout_ms / 1000, options.heartbeat_interval_ms / 1000)
        )
        self.names = [chr(ord("a") + i) for i in range(options.groups)]
        self.ev = options.events
        self._hist: dict[tuple, int] = {(): 0}
        self.hist: list[tuple[int, ...]] = [()]
        self._content: dict[tuple, int] = {}
        self.content: list[tuple] = []
        self._plan: dict[tuple[int, str], str | None] = {}
        # Quorum ids are renumbered only when every field that holds one is known here, and
        # not with "restart" (there a fresh lighthouse's own numbers matter).
        self._renumber = self.renumberable and "restart" not in options.events
        # A core whose requests carry the quorum of the group's last commit (its lineage).
        self.lineage = options.lineage and "lineage" in inspect.signature(core.join).parameters
        self._agree: dict[tuple[int, int], bool] = {}
        self._forget_cache: dict[tuple[int, bool], int] = {}

    # -- interning -------------------------------------------------------------------------

    def rid(self, g: int, inc: int) -> str:
        return f"{self.names[g]}{inc}"

    def intern_hist(self, h: tuple[int, ...]) -> int:
        ref = self._hist.get(h)
        if ref is None:
            ref = self._hist[h] = len(self.hist)
            self.hist.append(h)
        return ref

    def intern_content(self, contributions: tuple) -> int:
        ref = self._content.get(contributions)
        if ref is None:
            ref = self._content[contributions] = len(self.content)
            self.content.append(contributions)
        return ref

    def heal_source(self, qref: int, rid: str) -> str | None:
        """Whom ``rid`` heals from in quorum ``qref`` (plan.py, group rank 0), or None."""
        key = (qref, rid)
        if key not in self._plan:
            quorum = self.quorums[qref]
            result = compute_quorum_results(rid, 0, quorum, self.o.init_sync)
            src = None
            if result.heal:
                src = result.replica_ids[result.recover_src_replica_rank]
            self._plan[key] = src
        return self._plan[key]

    # -- states ----------------------------------------------------------------------------

    def initial(self) -> tuple:
        """Every group alive at step 0 with an open session, idle; a fresh lighthouse."""
        st = self.core.LighthouseState()
        groups = []
        for g in range(self.o.groups):
            self.core.session_opened(st, self.rid(g, 0), 0.0)
            groups.append(fresh_group(0))
        return (self.from_core(st, None), tuple(groups), (), self.o.faults)

    def quorum_id(self, state: tuple) -> int:
        return self.quorum_id_of(state[0])

    def is_final(self, state: tuple) -> bool:
        """Every group not dead is at the cap (and there is one): nothing is left to commit."""
        live = [g for g in state[1] if g[LIFE] != DEAD]
        return bool(live) and all(g[STEP] >= self.o.cap for g in live)

    def is_cut(self, state: tuple) -> bool:
        """The size bound: a quorum id above ``max_quorum_id`` is not explored further."""
        return self.quorum_id(state) > self.o.max_quorum_id

    def needs_progress(self, state: tuple) -> bool:
        """Liveness applies: enough groups not dead, not final, not cut."""
        live = sum(g[LIFE] != DEAD for g in state[1])
        return live >= self.o.min_replicas and not self.is_final(state) and not self.is_cut(state)

    # -- helpers on groups -----------------------------------------------------------------

    def locate(self, groups: tuple, rid: str) -> tuple | None:
        """The group tuple of incarnation ``rid``, or None if that incarnation is gone."""
        g = ord(rid[0]) - ord("a")
        grp = groups[g]
        if grp[INC] != int(rid[1:]) or grp[LIFE] == DEAD:
            return None
        return grp

    def gone(self, groups: tuple, rid: str, qref: int, contributed: bool) -> bool:
        """Whether member ``rid`` of ``qref`` may make the others' allreduce fail."""
        grp = self.locate(groups, rid)
        if grp is None or grp[LIFE] == FROZEN:
            return True
        return not contributed and (grp[Q] != qref or grp[PHASE] not in IN_STEP)

    def collective(self, groups: tuple, rounds: dict, i: int) -> tuple[bool, bool]:
        """(completable, may fail) for group ``i``, which sent its contribution."""
        grp = groups[i]
        qref = grp[Q]
        got = rounds.get(qref, frozenset())
        rids = {rid for rid, _ in got}
        me = self.rid(i, grp[INC])
        members = self.qinfo[qref][1]
        complete = all(rid in rids for rid in members)
        may_fail = any(self.gone(groups, rid, qref, rid in rids) for rid in members if rid != me)
        return complete, may_fail

    def pace(self, groups: tuple, rounds: dict, i: int) -> int:
        """How group ``i`` lets time pass: ``WAITING``, ``SLOW`` or ``URGENT``.

        A group waits (on the lighthouse, a peer, a frozen source) for as long as the clock
        likes. It may be slow only before it asks (an eval, a checkpoint save, a pause: the
        busy bound applies). Every other move of its own (heal, contribute, complete, vote, see
        its collective fail on a member that died or left) is made before the clock moves on:
        it takes no time the lighthouse could see. Slow to vote is not a case of its own: to
        the lighthouse it is one more group not asking, and a commit held back is a commit
        made first and kept to itself.
        """
        grp = groups[i]
        if grp[LIFE] != ALIVE:
            return WAITING
        phase = grp[PHASE]
        if phase == IDLE:
            return SLOW if grp[SESS] else WAITING
        if phase in (READY, DONE):
            return URGENT
        if phase == HEAL:
            src = self.locate(groups, grp[AUX])
            return WAITING if src is not None and src[LIFE] == FROZEN else URGENT
        if phase == SENT:
            complete, may_fail = self.collective(groups, rounds, i)
            if complete or (may_fail and not self._only_frozen(groups, grp)):
                return URGENT
        return WAITING

    def _only_frozen(self, groups: tuple, grp: tuple) -> bool:
        """A sent group whose allreduce waits only on frozen members is blocked."""
        for rid in self.qinfo[grp[Q]][1]:
            other = self.locate(groups, rid)
            if other is None:
                return False
            if other[LIFE] != FROZEN and (other[Q] != grp[Q] or other[PHASE] not in IN_STEP):
                return False
        return True

    def finish(self, lh: int, groups: list, rounds: dict, faults: int) -> tuple:
        """Normalise a successor into its canonical, hashable state.

        Each group's pace is set, a dead group keeps only its incarnation (nothing of it is
        read again), rounds no group is in are dropped, and quorum ids are renumbered.
        """
        frozen_groups = tuple(groups)
        for i, grp in enumerate(frozen_groups):
            if grp[LIFE] == DEAD:
                if grp != (dead := _dead(grp[INC])):
                    groups[i] = dead
                continue
            pace = self.pace(frozen_groups, rounds, i)
            if pace != grp[PACE]:
                groups[i] = _put(grp, PACE, pace)
        held = {g[Q] for g in groups if g[LIFE] != DEAD and g[PHASE] in (HEAL, READY, SENT)}
        kept = {q: c for q, c in rounds.items() if q in held}
        lh = self._forget(lh, groups, faults)
        if self._renumber:
            lh, kept = self._renumbered(lh, groups, kept)
        return (
            lh,
            tuple(groups),
            tuple(sorted((q, tuple(sorted(c))) for q, c in kept.items())),
            faults,
        )

    def _forget(self, lh: int, groups: list, faults: int) -> int:
        """Drop what can no longer change any decision (``groups`` updated in place).

        Once no fault is left: the quorum a group last received matters only to report it
        after a lighthouse restart, and the store's quorum only to reload it; and the join
        times of requests matter only through the earliest among the last quorum's members
        (the straggler window's start; the earliest among all when none of them asks): a
        request leaves only by its group's death or a restart, and turns unhealthy only if its
        group freezes, so while no group is frozen, every other request is as good as made now
        (a member of the last quorum that asks later asks at a later time).
        """
        if faults:
            return lh
        for i, g in enumerate(groups):
            if g[LASTQ] is not None and g[SESS]:
                groups[i] = _put(g, LASTQ, None)
        frozen = any(g[LIFE] == FROZEN for g in groups)
        key = (lh, frozen)
        if key not in self._forget_cache:
            parts, hbs, prev, prev_at, _stored, rest = self.lh[lh]
            if parts and not frozen:
                members = set() if prev is None else set(self.qinfo[prev][1])
                counted = [p for p in parts if p[0] in members] or list(parts)
                first = min(counted, key=lambda p: (p[1], p[0]))[0]
                parts = tuple((rid, t if rid == first else 0, key) for rid, t, key in parts)
            self._forget_cache[key] = self.lh_ref((parts, hbs, prev, prev_at, None, rest))
        return self._forget_cache[key]

    def _renumbered(self, lh: int, groups: list, rounds: dict) -> tuple[int, dict]:
        """Quorum ids renumbered 1..k in their order (``groups`` updated in place).

        The core compares ids only for order and equality, and takes the next one above the
        latest: two states that differ only in how many ids were spent behave alike. Done only
        while the lighthouse's latest id is the highest one known (a lighthouse restarted
        without its store numbers from 1 again, and there the values themselves matter).
        """
        parts, hbs, prev, prev_at, stored, rest = self.lh[lh]
        latest = rest[self._qid_index]
        used = set(self._lh_ids(lh))
        for ref in rounds:
            used.add(self.quorums[ref].quorum_id)
        for g in groups:
            if g[LIFE] != DEAD:
                used.add(g[LINEAGE])
                for ref in (g[Q], g[LASTQ]):
                    if ref is not None:
                        used.add(self.quorums[ref].quorum_id)
        used.discard(0)
        if not used or max(used) == len(used) or latest != max(used):
            return lh, rounds
        new = {old: n for n, old in enumerate(sorted(used), start=1)}
        new[0] = 0

        def ref(q: int | None) -> int | None:
            return None if q is None else self.renamed(q, new[self.quorums[q].quorum_id])

        for i, g in enumerate(groups):
            if g[LIFE] != DEAD:
                groups[i] = put(g, q=ref(g[Q]), lastq=ref(g[LASTQ]), lineage=new[g[LINEAGE]])
        rest = self._rest_renumbered(rest, new)
        lh = self.lh_ref((parts, hbs, ref(prev), prev_at, ref(stored), rest))
        return lh, {ref(q): c for q, c in rounds.items()}

    # -- invariants ------------------------------------------------------------------------

    def agree(self, h1: int, h2: int) -> bool:
        """Whether two histories agree on every step both committed."""
        if h1 == h2:
            return True
        key = (h1, h2) if h1 < h2 else (h2, h1)
        ok = self._agree.get(key)
        if ok is None:
            a, b = self.hist[h1], self.hist[h2]
            n = min(len(a), len(b))
            ok = self._agree[key] = a[:n] == b[:n]
        return ok

    def check_histories(self, groups: tuple) -> None:
        """Invariant 1: two groups alive and not frozen agree on every step both committed.

        A group the lighthouse took for dead (its heartbeat expired while it was frozen or
        cut off) is left out until it next heals or commits: see the checker's docstring.
        """
        if 1 not in self.o.invariants:
            return
        live = [(i, g) for i, g in enumerate(groups) if g[LIFE] == ALIVE and not g[OUT]]
        for x in range(len(live)):
            for y in range(x + 1, len(live)):
                (i, a), (j, b) = live[x], live[y]
                if not self.agree(a[HIST], b[HIST]):
                    raise Violation(
                        f"invariant 1 (one content per step): {self.rid(i, a[INC])} holds "
                        f"{self.render_hist(a[HIST])} and {self.rid(j, b[INC])} holds "
                        f"{self.render_hist(b[HIST])}, both alive"
                    )

    def render_hist(self, h: int) -> str:
        """A history as its steps' contributors, e.g. ``[abc|bc]`` (contents differ by base)."""
        steps = []
        for cid in self.hist[h]:
            contributions = self.content[cid]
            names = "".join(sorted(rid[0] for rid, _ in contributions))
            steps.append(f"{names}#{cid}")
        return "[" + "|".join(steps) + "]"


def _put(grp: tuple, index: int, value) -> tuple:
    lst = list(grp)
    lst[index] = value
    return tuple(lst)


def put(grp: tuple, **fields) -> tuple:
    """A copy of a group tuple with ``fields`` (names of the index constants, lowercase) set."""
    lst = list(grp)
    for name, value in fields.items():
        lst[_INDEX[name]] = value
    return tuple(lst)


_INDEX = {
    name: i
    for i, name in enumerate(
        "life sess step hist cf phase q aux doubt pace froze disc lastq inc lineage out".split()
    )
}


def _dead(inc: int) -> tuple:
    return (DEAD, False, 0, 0, 0, IDLE, None, None, False, WAITING, None, None, None, inc, 0, False)


def fresh_group(inc: int) -> tuple:
    """A group that just started: alive, with a session, idle at step 0 (incarnation ``inc``)."""
    return (ALIVE, True, 0, 0, 0, IDLE, None, None, False, SLOW, None, None, None, inc, 0, False)
