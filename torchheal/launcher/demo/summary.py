"""The closing summary of a demo run, computed from the events the groups reported."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from torchheal.launcher import RunResult


@dataclass(frozen=True)
class Recovery:
    """What one injected failure cost.

    Args:
        group: the killed group.
        survivor_stall_s: from the kill to the first step a survivor committed in a new quorum.
        rejoin_s: from the group's restart to its first committed step (None if it never did).
        healed: whether the restarted group reported that it healed from a peer.
        warm: whether the restarted group began in a warm spare (torch already imported).
    """

    group: int
    survivor_stall_s: float | None
    rejoin_s: float | None
    healed: bool
    warm: bool = False


@dataclass(frozen=True)
class Summary:
    """The demo's verdict.

    Args:
        steps_committed: the job's final step.
        failures: number of injected failures.
        recoveries: one entry per failure.
        typical_step_s: median time between commits on a healthy group.
        seconds_lost: survivors' stall beyond a typical step, summed over failures.
        identical: whether every group ended with bit-identical weights.
        digests: final weight digest per group.
        wall_s: duration of the whole run.
    """

    steps_committed: int
    failures: int
    recoveries: tuple[Recovery, ...]
    typical_step_s: float
    seconds_lost: float
    identical: bool
    digests: dict[int, str]
    wall_s: float


def _survivor_stall(kill_time: float, survivors: list[list[tuple[float, object]]]) -> float | None:
    """Seconds from the kill to the first survivor commit in a quorum formed after it.

    A commit that lands just after the kill but still in the old quorum is the step that was
    already in flight, not a recovery, so it does not count.
    """
    firsts = []
    for commits in survivors:
        before = [q for t, q in commits if t <= kill_time]
        old_quorum = before[-1] if before else None
        after = [t for t, q in commits if t > kill_time and q != old_quorum]
        if after:
            firsts.append(after[0])
    return min(firsts) - kill_time if firsts else None


def summarize(result: RunResult) -> Summary:
    """Reduce a run's events to the numbers the demo prints."""
    commits: dict[int, list[float]] = {}
    quorum_commits: dict[int, list[tuple[float, object]]] = {}
    heals: dict[int, list[float]] = {}
    warm_starts: dict[int, list[float]] = {}
    for e in result.events:
        if e.kind == "start" and e.fields.get("warm"):
            warm_starts.setdefault(e.group, []).append(e.time)
        if e.kind == "step" and e.fields.get("committed"):
            commits.setdefault(e.group, []).append(e.time)
            quorum_commits.setdefault(e.group, []).append((e.time, e.fields.get("quorum_id")))
        if e.kind == "step" and e.fields.get("healed"):
            heals.setdefault(e.group, []).append(e.time)
    never_killed = [g for g, p in result.groups.items() if not p.kills]
    gaps = [b - a for g in never_killed for a, b in itertools.pairwise(commits.get(g, []))]
    typical = statistics.median(gaps) if gaps else 0.0

    recoveries = []
    lost = 0.0
    for g, proc in result.groups.items():
        for kill_time in proc.kills:
            stall = _survivor_stall(kill_time, [quorum_commits.get(s, []) for s in never_killed])
            restarts = [t for t in proc.starts if t > kill_time]
            rejoin = None
            healed = warm = False
            if restarts:
                restart = restarts[0]
                again = [t for t in proc.kills if t > restart]  # this start's end, if killed
                until = again[0] if again else float("inf")
                own = [t for t in commits.get(g, []) if t > restart]
                rejoin = own[0] - restart if own else None
                healed = any(t > restart for t in heals.get(g, []))
                warm = any(restart < t < until for t in warm_starts.get(g, []))
            if stall is not None:
                lost += max(0.0, stall - typical)
            recoveries.append(Recovery(g, stall, rejoin, healed, warm))

    digests = {e.group: str(e.fields.get("digest")) for e in result.events if e.kind == "done"}
    steps = max(
        (int(e.fields.get("step", 0)) for e in result.events if e.kind == "done"), default=0
    )
    identical = len(digests) == len(result.groups) and len(set(digests.values())) == 1
    return Summary(
        steps_committed=steps,
        failures=sum(len(p.kills) for p in result.groups.values()),
        recoveries=tuple(recoveries),
        typical_step_s=typical,
        seconds_lost=lost,
        identical=identical,
        digests=digests,
        wall_s=result.ended - result.started,
    )


def render(summary: Summary) -> str:
    """The summary as the lines the demo prints at the end."""
    lines = [
        "",
        "== torchheal demo summary ==",
        f"steps committed        {summary.steps_committed}",
        f"failures survived      {summary.failures}",
    ]
    for r in summary.recoveries:
        stall = f"{r.survivor_stall_s:.2f}s" if r.survivor_stall_s is not None else "n/a"
        rejoin = f"{r.rejoin_s:.2f}s" if r.rejoin_s is not None else "n/a"
        started = "restarted group (a warm spare)" if r.warm else "restarted group"
        lines.append(
            f"  group {r.group} killed: survivors committed again after {stall}; "
            f"{started} committed after {rejoin}{' (healed live from a peer)' if r.healed else ''}"
        )
    lines += [
        f"typical step           {summary.typical_step_s * 1000:.0f} ms",
        f"seconds lost           {summary.seconds_lost:.2f}s (survivor stall beyond a normal step)",
        f"wall time              {summary.wall_s:.1f}s",
        f"identical weights      {'yes, bit-identical on every group' if summary.identical else 'NO'}",
    ]
    for g, d in sorted(summary.digests.items()):
        lines.append(f"  group {g}: sha256 {d[:16]}…")
    return "\n".join(lines)
