"""What a chaos soak must end with, checked from its events (pure: no I/O, no clock).

The ranks' ``step`` events (``bench/_chaos_worker.py``), tagged with group, incarnation and
rank, the faults the soak injected and the ranks' final states go in; problems (strings, empty
when all is well) and per-fault numbers come out.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

Event = dict[str, Any]


@dataclass
class Fault:
    """One injected fault.

    Args:
        kind: "kill" (SIGKILL of one rank; the group is ended and restarted), "stop" (SIGSTOP
            of every rank, SIGCONT at ``end``) or "cut" (its lighthouse path stalled until
            ``end``).
        group: the victim.
        start: when it was injected (wall clock).
        end: when it was lifted (the SIGCONT, the path's resumption, the restart).
        detail: what exactly (the rank killed, the duration).
        job_stall_s: the longest time the job committed no new step, from ``start`` until the
            victim was back.
        back_s: ``start`` until the victim's first commit in a full quorum after ``end``.
        data_lost: steps the job's committed step went back by, attributed to this fault.
    """

    kind: str
    group: int
    start: float
    end: float | None = None
    detail: str = ""
    job_stall_s: float | None = None
    back_s: float | None = None
    data_lost: int = 0
    notes: list[str] = field(default_factory=list)


def commits(events: list[Event]) -> list[Event]:
    return [e for e in events if e["kind"] == "step" and e["committed"]]


def full(e: Event, groups: int) -> bool:
    r = e["reduce"]
    return bool(e["committed"] and r and r["participating"] and r["divisor"] == groups)


def check_history(events: list[Event]) -> tuple[int, list[str]]:
    """Every committed step was committed once by the job's history: in one quorum, with one
    divisor; the steps are 0..N-1.

    One exception, which is no split brain: a stale re-run. A group cut off from the job for
    longer than the heartbeat timeout (its quorum rebuild hung, say) can come back when every
    other group looks dead to the lighthouse, which then issues it a quorum of its own (as the
    reference does at ``min_replicas=1``): it commits steps the job had already committed, from
    its own older state. That is allowed when (1) while that quorum committed, no other quorum
    went on committing (two quorums making progress at once is a split brain), and (2) every
    rank that re-ran a step later healed from a peer to at least the step the job had reached
    when the re-run began: the stale branch was dropped and lost nothing.

    Returns:
        (the number of committed steps, problems).
    """
    problems = []
    mine = commits(events)
    by_step: dict[int, dict[tuple[int, int], list[Event]]] = defaultdict(lambda: defaultdict(list))
    for e in mine:
        if e["reduce"] is None:
            problems.append(f"a commit without a reduction: {e}")
            continue
        by_step[e["after"] - 1][(e["reduce"]["quorum_id"], e["reduce"]["divisor"])].append(e)
    reduced = [e for e in mine if e["reduce"] is not None]
    for step, ways in sorted(by_step.items()):
        if len(ways) == 1:
            continue
        # The way that committed the step first is the job's; the later ones must be re-runs.
        ordered = sorted(ways.values(), key=lambda es: min(e["time"] for e in es))
        first = ordered[0][0]["reduce"]["quorum_id"]
        bad = [
            es
            for es in ordered[1:]
            if es[0]["reduce"]["quorum_id"] == first or not _dropped_rerun(es, reduced)
        ]
        if bad:
            problems.append(f"step {step} committed in different (quorum, divisor): {set(ways)}")
    steps = sorted(by_step)
    if steps != list(range(len(steps))):
        missing = sorted(set(range(max(steps, default=-1) + 1)) - set(steps))
        problems.append(f"committed steps are not 0..N-1: missing {missing[:20]}")
    return len(steps), problems


def _dropped_rerun(rerun: list[Event], events: list[Event]) -> bool:
    """``rerun`` (one step's commits in one quorum) re-ran a step the job had passed, alone,
    and every rank that ran it later healed past where the job was (see ``check_history``)."""
    quorum = rerun[0]["reduce"]["quorum_id"]
    ranks = {(e["group"], e["inc"], e["rank"]) for e in rerun}
    # The stale run began with these ranks' first commit in this quorum.
    began = min(
        e["time"]
        for e in events
        if e["reduce"]["quorum_id"] == quorum and (e["group"], e["inc"], e["rank"]) in ranks
    )
    reached = max((e["after"] for e in events if e["time"] < began), default=0)
    if reached <= rerun[0]["after"]:
        return False  # the job had not passed this step: two quorums committed it at once
    heals = [
        x
        for x in events
        if (x["group"], x["inc"], x["rank"]) in ranks
        and x["time"] > began
        and x["after"] > x["before"] + 1
        and x["after"] - 1 >= reached
    ]
    if {(x["group"], x["inc"], x["rank"]) for x in heals} != ranks:
        return False  # a rank kept the stale branch: the steps the job had reached are lost
    # From the re-run to the heal that dropped it, no other quorum may commit (the heal's own
    # quorum commits beside it). One step per rank is allowed: a commit that was in flight when
    # its group went quiet (a SIGSTOP between the reduction and the vote).
    healed_at = min(x["time"] for x in heals)
    allowed = {quorum} | {x["reduce"]["quorum_id"] for x in heals}
    beside: dict[tuple[int, int, int], set[int]] = defaultdict(set)
    for e in events:
        if began <= e["time"] < healed_at and e["reduce"]["quorum_id"] not in allowed:
            beside[(e["group"], e["inc"], e["rank"])].add(e["after"])
    return all(len(steps) <= 1 for steps in beside.values())


def check_ranks_agree(events: list[Event], done: set[tuple[int, int]]) -> list[str]:
    """The ranks of one start of a group committed the same steps (the group's vote).

    A start that was killed may have one rank that wrote one more commit line than the other
    before it died; a start that finished (``done``) must match exactly.
    """
    seqs: dict[tuple[int, int], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for e in commits(events):
        seqs[(e["group"], e["inc"])][e["rank"]].append(e["after"])
    problems = []
    for key, ranks in sorted(seqs.items()):
        lists = list(ranks.values())
        shortest = min(len(s) for s in lists)
        if any(s[:shortest] != lists[0][:shortest] for s in lists):
            problems.append(f"g{key[0]} start {key[1]}: ranks committed different steps")
        if key in done and (len(ranks) < 2 or any(len(s) != len(lists[0]) for s in lists)):
            problems.append(f"g{key[0]} start {key[1]} finished with ranks at different steps")
    return problems


def check_identical(states: dict[tuple[int, int], dict[str, Any]]) -> list[str]:
    """Rank ``r`` of every group ends with the same tensors as rank ``r`` of group 0.

    Args:
        states: ``(group, rank)`` -> the rank's final ``state_dict``.
    """
    problems = []
    for (g, r), state in sorted(states.items()):
        first = states[(0, r)]
        for key, value in state.items():
            if not torch.equal(value, first[key]):
                problems.append(f"g{g} rank {r} differs from g0 in {key}")
    return problems


def went_back(events: list[Event]) -> list[tuple[float, int, str]]:
    """Each time a rank's committed step went below one it had reached (time, steps, who)."""
    out = []
    top: dict[tuple[int, int, int], int] = {}
    for e in sorted(commits(events), key=lambda e: e["time"]):
        key = (e["group"], e["inc"], e["rank"])
        if key in top and e["after"] <= top[key]:
            out.append((e["time"], top[key] - e["after"] + 1, f"g{key[0]}i{key[1]}r{key[2]}"))
        top[key] = max(top.get(key, 0), e["after"])
    return out


def measure(faults: list[Fault], events: list[Event], groups: int) -> None:
    """Fills each fault's ``job_stall_s``, ``back_s`` and ``data_lost``."""
    ordered = sorted(commits(events), key=lambda e: e["time"])
    # When the job's committed step first reached each new value.
    advances: list[float] = []
    top = 0
    for e in ordered:
        if e["after"] > top:
            top = e["after"]
            advances.append(e["time"])
    backs = went_back(events)
    for f in faults:
        if f.end is None:
            f.notes.append("never lifted")
            continue
        back = next(
            (
                e["time"]
                for e in ordered
                if e["group"] == f.group and e["time"] > f.end and full(e, groups)
            ),
            None,
        )
        f.back_s = None if back is None else back - f.start
        until = back if back is not None else f.end
        inside = [t for t in advances if f.start <= t <= until]
        points = [f.start, *inside, until]
        f.job_stall_s = max(b - a for a, b in itertools.pairwise(points))
        f.data_lost = sum(n for t, n, _ in backs if f.start <= t <= until)


def summary_rows(faults: list[Fault]) -> list[tuple[str, ...]]:
    """The fault table: per kind, injected, survived, seconds lost, data lost."""

    def stats(values: list[float]) -> str:
        if not values:
            return "-"
        values = sorted(values)
        return f"{values[len(values) // 2]:.1f} / {values[-1]:.1f}"

    rows = []
    for kind in sorted({f.kind for f in faults}):
        mine = [f for f in faults if f.kind == kind]
        survived = [f for f in mine if f.back_s is not None]
        rows.append(
            (
                kind,
                str(len(mine)),
                str(len(survived)),
                stats([f.job_stall_s for f in mine if f.job_stall_s is not None]),
                stats([f.back_s for f in survived]),
                str(sum(f.data_lost for f in mine)),
            )
        )
    return rows
