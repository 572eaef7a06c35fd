"""The closing summary of a demo run, computed from the events the groups reported."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

from torchheal.data.plan import DataPlan, StepKey, positions
from torchheal.launcher import RunResult
from torchheal.launcher.events import Event


@dataclass(frozen=True)
class Recovery:
    """What one injected failure cost.

    Args:
        group: the killed group.
        survivor_stall_s: from the kill to the first step a survivor committed in a new quorum.
        rejoin_s: from the group's restart to its first committed step (None if it never did).
        healed: the restarted group reported that it healed from a peer.
        warm: the restarted group began in a warm spare.
    """

    group: int
    survivor_stall_s: float | None
    rejoin_s: float | None
    healed: bool
    warm: bool = False


@dataclass(frozen=True)
class SampleCheck:
    """Whether the committed steps read every sample once, from the groups' own reports
    (``steps``: committed steps with a report; ``problems``: empty when all is well)."""

    steps: int
    batch: int
    problems: tuple[str, ...]


def check_samples(events: list[Event]) -> SampleCheck | None:
    """Checks each committed step's reported reads against the data plan (None: none reported).

    Each contributing group must have read exactly its slice for the step's quorum, the step's
    groups must agree on the quorum, and no position may be read in two committed steps. A
    group killed between its commit and its report leaves its slice unreported.
    """
    reads = [
        e.fields
        for e in events
        if e.kind == "step"
        and e.fields.get("committed")
        and e.fields.get("rank") is not None
        and "lo" in e.fields
    ]
    if not reads:
        return None
    batch = int(reads[0]["batch"])
    plan = DataPlan(dataset_size=1, batch_size=batch)  # positions do not depend on the size
    problems: list[str] = []
    by_step: dict[int, list[dict]] = {}
    for f in reads:
        by_step.setdefault(int(f["data_step"]), []).append(f)
    for step, fs in sorted(by_step.items()):
        quorums = sorted({int(f["k"]) for f in fs})
        ranks = [int(f["rank"]) for f in fs]
        if len(quorums) > 1 or len(set(ranks)) < len(ranks):
            problems.append(f"step {step} committed twice (quorums of {quorums} groups)")
        for f in fs:
            want = positions(plan, StepKey(step, int(f["k"]), int(f["rank"])))
            if (int(f["lo"]), int(f["hi"])) != want:
                problems.append(f"step {step}: read {f['lo']}..{f['hi']}, the plan says {want}")
    spans = sorted({(int(f["lo"]), int(f["hi"])) for f in reads})
    for (_, hi), (lo, _) in itertools.pairwise(spans):
        if lo < hi:
            problems.append(f"samples at positions {lo}..{hi} read twice")
    return SampleCheck(len(by_step), batch, tuple(problems))


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
        samples: the exactly-once check of the data the groups read (None: not reported).
        comparisons: the divergence guard's ``(comparisons, mismatches)`` summed over the
            groups' ``done`` events (None: not reported).
    """

    steps_committed: int
    failures: int
    recoveries: tuple[Recovery, ...]
    typical_step_s: float
    seconds_lost: float
    identical: bool
    digests: dict[int, str]
    wall_s: float
    samples: SampleCheck | None = None
    comparisons: tuple[int, int] | None = None


def _survivor_stall(kill_time: float, survivors: list[list[tuple[float, object]]]) -> float | None:
    """Seconds from the kill to the first survivor commit in a quorum formed after it.

    A commit still in the old quorum is the step already in flight, not a recovery.
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
        samples=check_samples(result.events),
        comparisons=_comparisons(result.events),
    )


def _comparisons(events: list[Event]) -> tuple[int, int] | None:
    done = [e.fields for e in events if e.kind == "done" and "divergence_checks" in e.fields]
    if not done:
        return None
    checks = sum(int(f["divergence_checks"]) for f in done)
    return checks, sum(int(f.get("divergence_mismatches", 0)) for f in done)


def _comparisons_line(comparisons: tuple[int, int] | None) -> str:
    if comparisons is None:
        return "not reported"
    checks, mismatches = comparisons
    if checks == 0:
        return "no comparison ran"
    if mismatches:
        return f"{mismatches} of {checks} comparisons found groups holding different state"
    return f"{checks} comparisons of the groups' state fingerprints, all matched"


def _samples_line(check: SampleCheck | None) -> str:
    if check is None:
        return "not reported"
    if check.problems:
        more = f" (and {len(check.problems) - 1} more)" if len(check.problems) > 1 else ""
        return f"NOT each read once: {check.problems[0]}{more}"
    return (
        f"each read once ({check.steps} committed steps x {check.batch}, "
        "every step the plan's batch whoever was up)"
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
        f"samples                {_samples_line(summary.samples)}",
        f"state compared         {_comparisons_line(summary.comparisons)}",
    ]
    for g, d in sorted(summary.digests.items()):
        lines.append(f"  group {g}: sha256 {d[:16]}…")
    return "\n".join(lines)
