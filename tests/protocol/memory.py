"""The lighthouse's memory as plain, interned data, and the core's state built from it.

A model state holds the lighthouse's memory as a tuple: (participants, heartbeats, last quorum,
its issue time, the quorum its store holds, every other field of ``LighthouseState``). Times are
integer ms relative to now (always 0 in a stored state); quorums and members are interned to
small ints. :meth:`Memory.to_core` rebuilds a ``LighthouseState`` of the core under test from
it and :meth:`Memory.from_core` reads one back, so every decision is the core's own. Fields this
module does not know of (a newer core's) are carried along as frozen values, so the checker
follows the core as it grows; quorum ids are renumbered only when every field is known.
"""

from __future__ import annotations

from dataclasses import fields
from types import ModuleType

from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

# The lighthouse's memory: a tuple indexed by these.
LH_PARTS, LH_HBS, LH_PREV, LH_PREV_AT, LH_STORED, LH_REST = range(6)
WALL = Timestamp()

#: LighthouseState fields this model knows how to renumber (quorum ids in "quorum_id" and in
#: the values of "lineages" and "redone"; none in the others).
_KNOWN_FIELDS = {"quorum_id", "lineages", "redone", "sessions", "restored", "fresh_id"}


class Memory:
    """Interning tables and the conversions between the memory tuple and the core's state.

    Args:
        core: the quorum module under test.
        heartbeat_timeout_ms: heartbeat times older than this are all the same (expired).
        horizon_ms: join and issue times older than this are clamped (see ``model.py``).
        step_time_cap_ms: before a round's first request, issue times older than this are
            clamped (see ``model.py``).
    """

    def __init__(
        self, core: ModuleType, heartbeat_timeout_ms: int, horizon_ms: int, step_time_cap_ms: int
    ) -> None:
        self.core = core
        self.hb = heartbeat_timeout_ms
        self.horizon = horizon_ms
        self.step_time_cap = step_time_cap_ms
        # Interning tables: values <-> small ints, so states hash and compare fast.
        self._lh: dict[tuple, int] = {}
        self.lh: list[tuple] = []
        self._members: dict[tuple, QuorumMember] = {}
        self._q: dict[tuple, int] = {}
        self.quorums: list[Quorum] = []
        self.qinfo: list[tuple[int, tuple[str, ...]]] = []  # qref -> (max step, member ids)
        special = {"participants", "heartbeats", "prev_quorum", "prev_quorum_at"}
        self._rest = [f.name for f in fields(core.LighthouseState) if f.name not in special]
        self._qid_index = self._rest.index("quorum_id")
        fresh = core.LighthouseState()
        self._codecs = [(name, *self._codec(getattr(fresh, name))) for name in self._rest]
        self.renumberable = set(self._rest) <= _KNOWN_FIELDS
        self._renamed: dict[tuple[int, int], int] = {}
        # The lighthouse's decisions are functions of its memory alone: computed once each.
        self.tick_cache: dict[int, tuple | None] = {}
        self.lost_cache: dict[int, set[str]] = {}
        self.op_cache: dict[tuple[int, tuple], int] = {}
        self._ids_cache: dict[int, frozenset[int]] = {}

    def member(self, rid: str, step: int, cf: int) -> QuorumMember:
        key = (rid, step, cf)
        m = self._members.get(key)
        if m is None:
            m = QuorumMember(
                replica_id=rid,
                address=f"http://{rid}",
                store_address=f"{rid}:1",
                step=step,
                world_size=1,
                commit_failures=cf,
            )
            self._members[key] = m
        return m

    def qref(self, q: Quorum) -> int:
        key = (
            q.quorum_id,
            tuple((m.replica_id, m.step, m.commit_failures) for m in q.participants),
        )
        ref = self._q.get(key)
        if ref is None:
            ref = len(self.quorums)
            self._q[key] = ref
            members = tuple(self.member(*k) for k in key[1])
            self.quorums.append(Quorum(q.quorum_id, members, WALL))
            self.qinfo.append((max(m.step for m in members), tuple(k[0] for k in key[1])))
        return ref

    # -- the lighthouse's memory <-> the core's LighthouseState ----------------------------
    #
    # The memory is a tuple (participants, heartbeats, prev quorum, its issue time, the store's
    # quorum, every other field of LighthouseState): times in integer ms relative to now (0),
    # quorums interned; fields this model does not know of (a newer core's) are carried along
    # as frozen values, so the checker follows the core as it grows.

    def lh_ref(self, lh: tuple) -> int:
        ref = self._lh.get(lh)
        if ref is None:
            ref = self._lh[lh] = len(self.lh)
            self.lh.append(lh)
        return ref

    def to_core(self, ref: int):
        """A fresh ``LighthouseState`` of the core under test, holding memory ``ref``."""
        parts, hbs, prev, prev_at, _stored, rest = self.lh[ref]
        st = self.core.LighthouseState()
        st.participants = {rid: (t / 1000, self.member(*key)) for rid, t, key in parts}
        st.heartbeats = {rid: t / 1000 for rid, t in hbs}
        st.prev_quorum = None if prev is None else self.quorums[prev]
        st.prev_quorum_at = None if prev_at is None else prev_at / 1000
        for (name, _, thaw), value in zip(self._codecs, rest, strict=True):
            setattr(st, name, thaw(value))
        return st

    def from_core(self, st, stored: int | None) -> int:
        """Intern the memory held by ``st`` (``stored``: the quorum its store holds)."""
        parts = tuple(
            sorted(
                (rid, round(t * 1000), (m.replica_id, m.step, m.commit_failures))
                for rid, (t, m) in st.participants.items()
            )
        )
        return self.lh_ref(
            (
                parts,
                tuple(sorted((rid, round(t * 1000)) for rid, t in st.heartbeats.items())),
                None if st.prev_quorum is None else self.qref(st.prev_quorum),
                None if st.prev_quorum_at is None else round(st.prev_quorum_at * 1000),
                stored,
                tuple(freeze(getattr(st, name)) for name, freeze, _ in self._codecs),
            )
        )

    def shift_lh(self, ref: int, d: int) -> int:
        """The memory ``ref`` seen ``d`` ms later: every time moves back, clamped."""
        parts, hbs, prev, prev_at, stored, rest = self.lh[ref]
        hb, horizon = -self.hb, -self.horizon
        # Before the first request of a round, the issue time only sets the straggler grace to
        # come (twice the step): steps longer than the cap count as the cap.
        since_issue = horizon if parts else -self.step_time_cap
        return self.lh_ref(
            (
                tuple((rid, max(t - d, horizon), key) for rid, t, key in parts),
                tuple((rid, max(t - d, hb)) for rid, t in hbs),
                prev,
                None if prev_at is None else max(prev_at - d, since_issue),
                stored,
                rest,
            )
        )

    def _codec(self, default) -> tuple:
        """(freeze, thaw) for a field whose fresh value is ``default``: plain dicts and sets of
        scalars fast, anything else through the general pair below."""
        scalars = (int, float, str, bool, type(None))
        if isinstance(default, dict) and all(isinstance(v, scalars) for v in default.values()):
            return (lambda v: tuple(sorted(v.items()))), dict
        if isinstance(default, (set, frozenset)):
            return (lambda v: tuple(sorted(v))), set
        if isinstance(default, scalars):
            return (lambda v: v), (lambda v: v)
        return self._freeze, self._thaw

    def _freeze(self, value):
        if isinstance(value, dict):
            return ("dict", tuple(sorted((k, self._freeze(v)) for k, v in value.items())))
        if isinstance(value, (set, frozenset)):
            return ("set", tuple(sorted(value)))
        if isinstance(value, list):
            return ("list", tuple(self._freeze(v) for v in value))
        if isinstance(value, Quorum):
            return ("quorum", self.qref(value))
        return value

    def _thaw(self, value):
        if not isinstance(value, tuple):
            return value
        kind, body = value
        if kind == "dict":
            return {k: self._thaw(v) for k, v in body}
        if kind == "set":
            return set(body)
        if kind == "list":
            return [self._thaw(v) for v in body]
        return self.quorums[body]

    def quorum_id_of(self, ref: int) -> int:
        """The lighthouse's latest quorum id in memory ``ref``."""
        return self.lh[ref][LH_REST][self._qid_index]

    def _lh_ids(self, lh: int) -> frozenset[int]:
        """The quorum ids the lighthouse's memory ``lh`` holds."""
        ids = self._ids_cache.get(lh)
        if ids is None:
            _parts, _hbs, prev, _at, stored, rest = self.lh[lh]
            found = [rest[self._qid_index]]
            for name, value in zip(self._rest, rest, strict=True):
                if name in ("lineages", "redone"):
                    found.extend(v for _, v in value)
            found.extend(self.quorums[r].quorum_id for r in (prev, stored) if r is not None)
            ids = self._ids_cache[lh] = frozenset(found)
        return ids

    def _rest_renumbered(self, rest: tuple, new: dict[int, int]) -> tuple:
        out = []
        for name, value in zip(self._rest, rest, strict=True):
            if name == "quorum_id":
                value = new[value]
            elif name in ("lineages", "redone"):
                value = tuple((k, new[v]) for k, v in value)
            out.append(value)
        return tuple(out)

    def renamed(self, qref: int, quorum_id: int) -> int:
        """The interned quorum ``qref`` under another id."""
        key = (qref, quorum_id)
        ref = self._renamed.get(key)
        if ref is None:
            quorum = self.quorums[qref]
            ref = self._renamed[key] = self.qref(Quorum(quorum_id, quorum.participants, WALL))
        return ref
