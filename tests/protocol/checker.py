"""Exhaustive interleaving checker of the commit protocol (issue 40), over the real lighthouse core.

Breadth-first search over every interleaving of the events of ``events.py`` on the world of
``model.py`` (the real ``quorum.py``, N abstract replica groups), with a visited set of canonical
states (times relative to ``now``, quorum ids renumbered in order), up to a bounded size. After
every transition it checks:

1. one content per step: two groups alive and not frozen hold histories that agree on every step
   both committed. Not the stricter form (any two commits ever): a group that commits and dies
   before anyone hears of it takes its commit with it, and the others must redo the step. Nor,
   for the same reason, for a group the lighthouse took for dead (its heartbeat expired while it
   was frozen or cut off): it is compared again once it has healed or committed, and until then
   invariant 2 checks that it never trains on what it holds;
2. trains on the same history: every contribution to one quorum's allreduce comes from the same
   history (after any heal);
3. no step goes back: no issued quorum's highest step is below the step of a live group that is
   not frozen (and not taken for dead, as above);
4. liveness under fair scheduling: from every explored state in which at least ``min_replicas``
   groups are not dead (frozen ones thaw) and one is below the cap, a path of protocol events
   only (no fault) reaches a commit or the end of the run. Judged on the explored graph,
   backwards from the states with a commit along protocol edges; states cut by the size bound
   count as good (what lies beyond them is not explored).

The first violation is reported with the shortest trace that leads to it, one event per line.
``python -m tests.protocol.checker --size large`` (``make check-protocol``) or ``--size suite``;
``--quorum-module PATH`` checks another version of the lighthouse core (the one before issue
40's fix: ``git show e295b34~1:torchheal/coordination/quorum.py``); ``--events`` and
``--add-events`` pick the event families, ``--invariants`` which invariants stop the search.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

from tests.protocol.events import Event, successors
from tests.protocol.model import (
    DEAD,
    EVENT_FAMILIES,
    FROZEN,
    HIST,
    INC,
    LIFE,
    PHASE,
    PHASE_NAMES,
    STEP,
    Model,
    Options,
    Q,
)

#: The event families each size explores; all of them pass on today's core. Left out, each
#: for a hole the checker finds in today's rules (see ``EXCLUDED``).
SUITE_EVENTS = frozenset({"die", "error"})
LARGE_EVENTS = SUITE_EVENTS | {"freeze", "restart_store"}
#: Families left out of the sizes below, and why: run them with ``--add-events``.
EXCLUDED = {
    "hang": "a group busy past LIVE_HOLDER_WAIT_S is given up on, by design",
    "long_freeze": "a group the lighthouse takes for dead comes back; with two faults, a "
    "superseded member's request hides a live holder's commit from the holder rule",
    "slow_reconnect": "after a restart, a group cut off past the heartbeat timeout is taken for "
    "dead, as a frozen one",
    "restart": "a lighthouse restarted without its store issues the first quorum to the first "
    "group that reconnects if it reports no quorum",
    "rejoin": "a member left out of the last quorum while it holds the newest commit is not "
    "waited for once the members that carried it die",
    "lost_notices": "notices lost: only the nondeterministic failures remain (no hole found)",
}
SIZES = {
    "tiny": Options(groups=3, cap=2, faults=1, events=SUITE_EVENTS),
    "suite": Options(groups=3, cap=3, faults=1, events=SUITE_EVENTS),
    "large": Options(groups=3, cap=3, faults=1, events=LARGE_EVENTS),
}


@dataclass
class Result:
    """What one exploration found.

    Args:
        states: distinct states explored.
        transitions: transitions followed (each checked against invariants 1 to 3).
        seconds: wall time of the search and the liveness judgement.
        violation: the first invariant broken (None: none).
        trace: the events that lead to it from the initial state, one readable line each.
        live_checked: states to which invariant 4 applied.
        max_distance: the longest shortest path of protocol events to a commit among them.
        cut: states not expanded because of the size bound.
        invariants: the invariants checked.
    """

    states: int = 0
    transitions: int = 0
    seconds: float = 0.0
    violation: str | None = None
    trace: list[str] = field(default_factory=list)
    live_checked: int = 0
    max_distance: int = 0
    cut: int = 0
    invariants: frozenset[int] = frozenset()

    def summary(self) -> str:
        verdict = "no violation" if self.violation is None else "VIOLATION"
        checked = ", ".join(str(i) for i in sorted(self.invariants - {4}))
        live = (
            f"; invariant 4 on {self.live_checked} states (longest shortest path to a commit: "
            f"{self.max_distance} events)"
            if 4 in self.invariants and self.violation is None
            else ""
        )
        return (
            f"{self.states} states, {self.transitions} transitions, {self.seconds:.1f} s: "
            f"{verdict}; invariants {checked or '-'} checked on every transition{live}; "
            f"{self.cut} states cut by the quorum-id bound"
        )


def load_core(path: str | Path | None = None) -> ModuleType:
    """A private copy of a lighthouse core module: the current one, or the file at ``path``.

    The copy is a separate module object, so patching it (a test replaces one rule to restore
    an older version) changes nothing of ``torchheal.coordination.quorum``.
    """
    if path is None:
        spec = importlib.util.find_spec("torchheal.coordination.quorum")
        assert spec is not None and spec.origin is not None
        path = spec.origin
    name = f"_checked_quorum_{next(_LOADED)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a quorum module from {path}")
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class body runs.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_LOADED = itertools.count()


def explore(
    options: Options,
    core: ModuleType | None = None,
    max_states: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Result:
    """Explore every interleaving at ``options``' size; stop at the first violation.

    Args:
        options: size and event families.
        core: the quorum module to check (default: a copy of the current one).
        max_states: stop expanding after this many states (None: no limit).
        progress: called with the states count every 100 000 states.
    """
    started = time.perf_counter()
    model = Model(options, core if core is not None else load_core())
    init = model.initial()
    index = {init: 0}
    states = [init]
    parent = array("i", [-1])
    via: list[Event | None] = [None]
    commits = bytearray(1)
    good_src, good_dst = array("i"), array("i")
    result = Result(invariants=options.invariants)
    queue = deque([0])
    while queue:
        i = queue.popleft()
        state = states[i]
        if model.is_final(state):
            continue
        if model.is_cut(state):
            result.cut += 1
            continue
        if max_states is not None and len(states) >= max_states:
            continue
        for event, nxt, fault, commit, broken in successors(model, state):
            result.transitions += 1
            if broken is not None:
                result.violation = broken
                result.trace = render_trace(model, [*_path(parent, via, i), event])
                result.states = len(states)
                result.seconds = time.perf_counter() - started
                return result
            j = index.get(nxt)
            if j is None:
                j = index[nxt] = len(states)
                states.append(nxt)
                parent.append(i)
                via.append(event)
                commits.append(0)
                queue.append(j)
                if progress is not None and j % 100_000 == 0:
                    progress(j)
            if not fault:
                if commit:
                    commits[i] = 1
                good_src.append(i)
                good_dst.append(j)
    result.states = len(states)
    if 4 in options.invariants:
        _judge_liveness(model, states, commits, good_src, good_dst, parent, via, result)
    result.seconds = time.perf_counter() - started
    return result


def _path(parent: array, via: list, i: int) -> list[Event]:
    events = []
    while i > 0:
        events.append(via[i])
        i = parent[i]
    return events[::-1]


def _judge_liveness(model, states, commits, good_src, good_dst, parent, via, result) -> None:
    """Invariant 4: backwards from the commits along protocol edges; report a state left out."""
    n = len(states)
    distance = array("i", [-1]) * n
    frontier = []
    for i, state in enumerate(states):
        if commits[i] or model.is_final(state) or model.is_cut(state):
            distance[i] = 0
            frontier.append(i)
    # Reverse adjacency in compressed form: the sources of the protocol edges into each state.
    count = array("i", [0]) * (n + 1)
    for j in good_dst:
        count[j + 1] += 1
    for j in range(n):
        count[j + 1] += count[j]
    fill = array("i", count)
    sources = array("i", [0]) * len(good_dst)
    for i, j in zip(good_src, good_dst, strict=True):
        sources[fill[j]] = i
        fill[j] += 1
    depth = 0
    while frontier:
        depth += 1
        nxt = []
        for j in frontier:
            for k in range(count[j], count[j + 1]):
                i = sources[k]
                if distance[i] < 0:
                    distance[i] = depth
                    nxt.append(i)
        frontier = nxt
    for i, state in enumerate(states):
        if not model.needs_progress(state):
            continue
        result.live_checked += 1
        if distance[i] < 0:
            result.violation = (
                "invariant 4 (liveness): from this state no path of protocol events reaches a "
                "commit"
            )
            result.trace = render_trace(model, _path(parent, via, i))
            return
        result.max_distance = max(result.max_distance, distance[i])


# -- rendering --------------------------------------------------------------------------------


def render_trace(model: Model, events: list[Event]) -> list[str]:
    """Replay ``events`` from the initial state; one line per event with the state after it."""
    state = model.initial()
    lines = [f"  0. {'start':<30} | {render_state(model, state)}"]
    for n, event in enumerate(events, start=1):
        nxt = None
        for candidate, after, _fault, _commit, broken in successors(model, state):
            if candidate == event:
                nxt = after
                if broken is not None:
                    lines.append(f"{n:3}. {_describe(model, state, event):<30} | BROKEN: {broken}")
                break
        if nxt is None:
            break
        state = nxt
        lines.append(f"{n:3}. {_describe(model, state, event):<30} | {render_state(model, state)}")
    return lines


def _describe(model: Model, state: tuple, event: Event) -> str:
    kind, g, arg = event
    if kind == "advance":
        return f"clock +{arg / 1000:g} s"
    if kind == "tick":
        quorum = model.quorums[arg]
        members = " ".join(f"{m.replica_id}@{m.step}" for m in quorum.participants)
        return f"tick: quorum {quorum.quorum_id} {{{members}}}"
    if g < 0:
        return kind
    rid = model.rid(g, state[1][g][INC])
    if kind in ("heal", "heal_fail"):
        return f"{rid} {kind} from {arg}"
    return f"{rid} {kind}"


def render_state(model: Model, state: tuple) -> str:
    """Each group as ``a0 s1 sent(q2) [abc#0]``: replica id, step, phase, history."""
    parts = []
    for g, grp in enumerate(state[1]):
        rid = model.rid(g, grp[INC])
        if grp[LIFE] == DEAD:
            parts.append(f"{rid} dead")
            continue
        phase = PHASE_NAMES[grp[PHASE]]
        if grp[Q] is not None:
            phase += f"(q{model.quorums[grp[Q]].quorum_id})"
        frozen = " FROZEN" if grp[LIFE] == FROZEN else ""
        parts.append(f"{rid} s{grp[STEP]} {phase}{frozen} {model.render_hist(grp[HIST])}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Command line: explore one size, print the result; exit 1 on a violation."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="suite")
    parser.add_argument("--quorum-module", help="path of the quorum.py to check")
    parser.add_argument(
        "--events",
        help="comma-separated event families (default: the size's); known: "
        + ", ".join(sorted(EVENT_FAMILIES)),
    )
    parser.add_argument("--add-events", help="families added to the default set")
    parser.add_argument("--groups", type=int)
    parser.add_argument("--cap", type=int)
    parser.add_argument("--faults", type=int)
    parser.add_argument("--max-states", type=int)
    parser.add_argument("--invariants", help="comma-separated, of 1,2,3,4 (default: all)")
    parser.add_argument(
        "--heal-keeps-lineage",
        action="store_true",
        help="a group that heals keeps its own lineage until it commits (the Manager before it "
        "reported its heals: the lighthouse then drops a newer commit)",
    )
    args = parser.parse_args(argv)

    options = SIZES[args.size]
    events = options.events if args.events is None else frozenset(args.events.split(",")) - {""}
    if args.add_events:
        events |= frozenset(args.add_events.split(","))
    changes: dict = {"events": events}
    for name in ("groups", "cap", "faults"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.invariants:
        changes["invariants"] = frozenset(int(i) for i in args.invariants.split(","))
    if args.heal_keeps_lineage:
        changes["heal_takes_lineage"] = False
    options = replace(options, **changes)
    core = load_core(args.quorum_module)
    print(
        f"checking {args.quorum_module or 'torchheal/coordination/quorum.py'}: {options.groups} "
        f"groups, cap {options.cap}, {options.faults} faults, events {sorted(events)}, "
        f"advances {list(options.advances_ms)} ms",
        flush=True,
    )
    result = explore(
        options,
        core,
        args.max_states,
        progress=lambda n: print(f"  ... {n} states", flush=True),
    )
    print(result.summary())
    if result.violation is not None:
        print(result.violation)
        print("\n".join(result.trace))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
