"""What ``bench/versus.py``'s runs measured: the table, the per-event costs, the chart.

Every way's events are goodput's (``step`` with ``before``/``after``/``committed``/
``participants``, ``exec``, ``ready``, ``saved``, ``eval``, ``done``), so one set of functions
reads them all. Times are from the job's first commit (the trace's zero) to its commit of step N.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench.goodput import LOSS_WINDOW_S, _lost
from bench.versus_runs import WayRun


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def job_steps(run: WayRun) -> list[tuple[float, int]]:
    """(time, step) of each step number's first commit: the job's progress, a step once."""
    first: dict[int, float] = {}
    for e in run.events:
        if e["kind"] == "step" and e["committed"]:
            first[e["after"]] = min(first.get(e["after"], e["t"]), e["t"])
    return sorted((t, s) for s, t in first.items())


def progress(run: WayRun) -> list[tuple[float, int]]:
    """(seconds from t0, step) of every commit in time order: a restart from a save goes back."""
    commits = sorted(
        (e["t"], e["after"]) for e in run.events if e["kind"] == "step" and e["committed"]
    )
    out, best = [], 0
    for t, s in commits:
        if s < best - 1 or s > best:  # a restart went back (checkpoint) or the job moved on
            best = s
            out.append((t - run.t0, s))
    return out


def _healthy_gaps(run: WayRun) -> list[float]:
    """Gaps between the job's steps away from failures (outside ``LOSS_WINDOW_S`` after each)
    and from saves (a save's wait lands in the gap after its step: it is a save, not a step)."""
    saves = {e["step"] for e in run.events if e["kind"] == "saved"}
    steps = [(t, s) for t, s in job_steps(run) if run.t0 <= t <= (run.t_end or t)]
    return [
        b - a
        for (a, s), (b, _) in itertools.pairwise(steps)
        if s not in saves and not any(k <= b and a <= k + LOSS_WINDOW_S for k, _ in run.kills)
    ]


def lost_until(times: list[float], at: float, end: float) -> float | None:
    """Job time lost from a failure at ``at`` until ``end`` (the next failure, or step N),
    against the pace of the ``LOSS_WINDOW_S`` before it: the whole cost of one failure, its
    rejoin and anything after included (goodput's ``_lost`` stops at ``LOSS_WINDOW_S``)."""
    before = [t for t in times if at - LOSS_WINDOW_S <= t <= at]
    after = [t for t in times if at < t <= end]
    if len(before) < 3:
        return None
    pace = (before[-1] - before[0]) / (len(before) - 1)
    return ((after[-1] if after else end) - before[-1]) - len(after) * pace


@dataclass
class WayStats:
    """One way's row and the per-event costs the model takes from it."""

    name: str
    time_to_n: float
    failures: int
    redone: int
    samples_lost: float  # fraction of group-steps a missing group did not contribute
    final_loss: float | None
    step_s: float  # mean healthy step (away from failures and saves)
    median_step_s: float
    save_s: float | None = None  # ckpt: one save (slowest rank)
    save_every: int = 0
    restart_s: float | None = None  # ckpt: kill -> first step after restart, less one step
    detect_s: float | None = None  # ckpt: kill -> the new ranks' interpreters start
    load_s: float | None = None  # ckpt: reading the checkpoint back
    stall_s: float | None = None  # ft: job time lost in the LOSS_WINDOW_S after a kill
    lost_s: float | None = None  # ft: job time lost from a kill to the next (or to step N)
    out_s: float | None = None  # ft: kill -> the victim's first commit again
    noise_loss: float | None = None  # held-out loss at 95% of the steps


def stats(run: WayRun, groups: int) -> WayStats:
    """The table's row of ``run`` and its per-event costs."""
    assert run.t_end is not None
    done_steps = job_steps(run)
    by_step = {}
    for e in run.events:
        if e["kind"] == "step" and e["committed"]:
            by_step.setdefault(e["after"], e["participants"])
    present = sum(min(groups, by_step.get(s, groups)) for s in range(1, run.steps + 1))
    s = WayStats(
        name=run.name,
        time_to_n=run.t_end - run.t0,
        failures=len(run.kills),
        redone=_redone(run),
        samples_lost=1.0 - present / (groups * run.steps),
        final_loss=run.final_loss,
        step_s=statistics.fmean(_healthy_gaps(run)),
        median_step_s=statistics.median(_healthy_gaps(run)),
        save_every=run.save_every,
    )
    evals = [e["eval_loss"] for e in run.events if e["kind"] == "eval"]
    s.noise_loss = evals[-1] if evals else None
    if run.save_every:
        _ckpt_costs(run, s)
    else:
        _ft_costs(run, s, [t for t, _ in done_steps])
    return s


def _redone(run: WayRun) -> int:
    """Steps computed and then thrown away: back to the save (ckpt), or failed votes (ft)."""
    if run.save_every:
        best: dict[int, int] = defaultdict(int)  # incarnation -> last step it committed
        resumed: dict[int, int] = {}
        for e in run.events:
            if e["kind"] == "step" and e["committed"]:
                best[e["inc"]] = max(best[e["inc"]], e["after"])
            if e["kind"] == "ready":
                resumed[e["inc"]] = e["step"]
        return sum(max(0, best[i - 1] - resumed[i]) for i in resumed if i > 0)
    up = {(e["group"], e["inc"]) for e in run.events if e["kind"] == "step" and e["committed"]}
    return len(
        {
            e["before"]
            for e in run.events
            if e["kind"] == "step" and not e["committed"] and (e["group"], e["inc"]) in up
        }
    )


def _ckpt_costs(run: WayRun, s: WayStats) -> None:
    saves: dict[int, float] = defaultdict(float)
    for e in run.events:
        if e["kind"] == "saved":
            saves[e["step"]] = max(saves[e["step"]], e["save_s"])
    s.save_s = _mean(list(saves.values()))
    s.load_s = _mean([e["load_s"] for e in run.events if e["kind"] == "ready" and e["inc"] > 0])
    restarts, detects = [], []
    for n, (at, _) in enumerate(run.kills, 1):
        first = min(
            (e["t"] for e in run.events if e["kind"] == "step" and e["inc"] == n), default=None
        )
        began = min(
            (e["t"] for e in run.events if e["kind"] == "exec" and e["inc"] == n), default=None
        )
        if first is not None:
            restarts.append(first - at - s.step_s)
        if began is not None:
            detects.append(began - at)
    s.restart_s, s.detect_s = _mean(restarts), _mean(detects)


def _ft_costs(run: WayRun, s: WayStats, times: list[float]) -> None:
    stalls, losses, outs = [], [], []
    kills_of: dict[int, int] = defaultdict(int)
    for n, (at, victim) in enumerate(run.kills):
        kills_of[victim] += 1
        end = min([run.t_end or at] + [k for k, _ in run.kills[n + 1 :]])
        stall = _lost(times, at, max(end, at + 1e-3))
        lost = lost_until(times, at, max(end, at + 1e-3))
        if stall is not None and lost is not None:
            stalls.append(stall)
            losses.append(lost)
        back = [
            e["t"]
            for e in run.events
            if e["kind"] == "step"
            and e["committed"]
            and e["group"] == victim
            and e["inc"] == kills_of[victim]
        ]
        if back:
            outs.append(min(back) - at)
    s.stall_s, s.lost_s, s.out_s = _mean(stalls) or 0.0, _mean(losses) or 0.0, _mean(outs)


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else f"{x:{fmt}}"


def table(
    rows: list[WayStats],
    ideal_step_s: float,
    steps: int,
    free: WayStats | None,
    loss_band: float | None,
) -> list[str]:
    """The headline table, one line per way, and the loss verdict."""
    out = [
        f"{'way':<22}{'time to N s':>12}{'/ free':>8}{'ETTR':>7}{'failures':>9}{'redone':>8}"
        f"{'samples lost':>13}{'final loss':>11}{'step s':>8}"
    ]
    base = free.time_to_n if free else None
    for r in rows:
        ettr = (steps - 1) * ideal_step_s / r.time_to_n
        out.append(
            f"{r.name:<22}{r.time_to_n:>12.1f}{_f(base and r.time_to_n / base, '.3f'):>8}"
            f"{ettr:>7.3f}{r.failures:>9}{r.redone:>8}{100 * r.samples_lost:>12.1f}%"
            f"{_f(r.final_loss, '.4f'):>11}{r.step_s:>8.3f}"
        )
    ref = next((r for r in rows if r.save_every), None)
    if ref is not None and ref.final_loss is not None and loss_band is not None:
        out.append(
            f"final loss against checkpoint-and-restart's ({ref.final_loss:.4f}; it replays the "
            f"failure-free batches exactly), noise band {loss_band:.4f} = the change of its held-out "
            "loss over the last 5% of the steps:"
        )
        for r in rows:
            if r is ref or r.final_loss is None:
                continue
            d = r.final_loss - ref.final_loss
            verdict = "agrees" if abs(d) <= loss_band else "DIFFERS: its comparison is void"
            out.append(f"  {r.name:<22} {d:+.4f}  {verdict}")
    return out


def chart(runs: list[WayRun], path: Path, title: str) -> Path | None:
    """Committed step against wall-clock time, one line per way, its failures marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no chart: matplotlib is not installed (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    for run in runs:
        pts = progress(run)
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        style = {}
        if not run.kills and "free" in run.name:  # baselines: grey, the reference's dotted
            style = {"linestyle": ":" if run.name.startswith("torchft") else "--", "color": "grey"}
        (line,) = ax.step(xs, ys, where="post", label=run.name, linewidth=1.4, **style)
        kx = [at - run.t0 for at, _ in run.kills]
        ky = [_step_at(pts, x) for x in kx]
        ax.plot(kx, ky, "x", color=line.get_color(), markersize=7)
    ax.set_xlabel("wall-clock seconds from the first step")
    ax.set_ylabel("committed step")
    ax.set_title(title + "  (x: a rank SIGKILLed)", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _step_at(pts: list[tuple[float, int]], x: float) -> int:
    at = 0
    for t, s in pts:
        if t > x:
            break
        at = s
    return at
