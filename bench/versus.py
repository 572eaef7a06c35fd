"""torchheal against what people use instead, on the same work and the same failures (issue 45).

The same model, data and optimizer (``bench/versus_worker.py``: goodput's ~6.3M-parameter MLP,
AdamW, batch 32 per rank, one torch thread, ``--compute-s`` of sleep per step standing for an
accelerator's share) are trained to ``--steps`` N by ``--groups`` ranks, three ways, each on the
same failure trace (seeded exponential times between failures of mean ``--mtbf`` seconds, or a
``--trace`` file; a failure is a SIGKILL of one rank):

1. ``ckpt-restart``: torchrun ``--max-restarts`` over stock DDP (Gloo), a
   ``torch.distributed.checkpoint`` save every K steps; a failure restarts the whole job from the
   newest save. K by Young's rule, sqrt(2 * save time * MTBF) over the step time, from a short
   failure-free calibration run that measures both (or ``--save-every``).
2. ``torchft cold``: the reference, one process per replica group, a victim restarted cold.
3. ``torchheal cold`` and ``torchheal warm``: a victim restarted cold, or in a warm spare
   (``torchheal.launcher.spare``, forked from a template that imported torch at launch).

And torchheal without failures, its own baseline. Each way's row: time from the first step to
step N, against torchheal's failure-free time; ETTR (N steps at the calibration's failure-free
plain-DDP step time over the wall time); failures applied; steps redone; the share of
group-steps a missing group did not contribute; the final held-out loss (all ways must agree
within the loss change over the last 5% of steps, or the comparison is void). Then the model of
``bench/versus_model.py`` fed with the per-event costs just measured, checked against each run,
and its projection to the published failure rates of large clusters. The chart (committed step
against wall-clock time, failures marked) is written to ``--chart``.

    python -m bench.versus                              # ~27 min on 2 cores
    python -m bench.versus --steps 200 --mtbf 10 --ways ckpt,torchheal-warm --free ""
    python -m bench.versus --report DIR                 # the tables of a run kept with --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._cluster import reference_available
from bench.versus_model import (
    PUBLISHED,
    CkptCosts,
    Cluster,
    FtCosts,
    MeasuredFt,
    at_scale_ckpt,
    at_scale_ft,
    wall_ckpt,
    wall_ft,
    young_interval,
)
from bench.versus_report import WayStats, chart, stats, table
from bench.versus_runs import WayRun, load_trace, make_trace, run_ckpt, run_ft

WAYS = ("ckpt", "torchft-cold", "torchheal-cold", "torchheal-warm")
FREE = "failure-free"
#: A failure-free run that missed more of its group-steps than this did not do the same work.
SAME_WORK = 0.05


@dataclass
class Meta:
    """What the runs shared: the calibration's step and save times, K, the trace's mean."""

    groups: int
    steps: int
    mtbf: float
    ideal_step_s: float
    save_s: float
    save_every: int
    compute_s: float


def calibrate(args: argparse.Namespace, out: Path) -> tuple[float, float]:
    """(step s, save s) of failure-free plain DDP saving every 10 steps (torchrun, no kills)."""
    cal = argparse.Namespace(**{**vars(args), "steps": args.cal_steps})
    run = run_ckpt(cal, [], 10, out, name="calibration")
    s = stats(run, args.groups)
    assert s.save_s is not None
    return s.step_s, s.save_s


def run_way(way: str, args, trace, save_every: int, out: Path) -> WayRun:
    if way == "ckpt":
        return run_ckpt(args, trace, save_every, out, name=f"ckpt-restart K={save_every}")
    impl, restart = way.split("-")
    return run_ft(args, trace, impl, restart, out, f"{impl} {restart}")


@dataclass
class Measured:
    """The rows, and what they are measured against."""

    rows: list[WayStats]  # the ways under failures
    free: dict[str, WayStats]  # impl -> its failure-free run
    ideal_s: float  # plain DDP's healthy step (checkpoint-and-restart's run, else calibration)
    steps: int

    def base_step(self, r: WayStats) -> tuple[float, str]:
        """A way's failure-free step: its library's failure-free run, unless that run did other
        work (over :data:`SAME_WORK` of its group-steps missing: groups left out of the quorum
        train faster on fewer samples), else its own run's median away from failures."""
        f = self.free.get(r.name.split()[0])
        if f is not None and f.samples_lost <= SAME_WORK:
            return f.time_to_n / (self.steps - 1), "failure-free run"
        return r.median_step_s, "own run's median away from kills"


def model_check(meta: Meta, m: Measured) -> list[str]:
    """Each run's time to N as the model predicts it from per-event costs, against the measured."""
    out = [f"{'way':<22}{'measured s':>11}{'model s':>9}{'error':>8}  inputs"]
    for r in m.rows:
        if r.save_every:
            c = CkptCosts(r.step_s, r.save_s or 0.0, r.restart_s or 0.0)
            pred = wall_ckpt(c, meta.steps, r.save_every, r.failures)
            inputs = (
                f"step {c.step_s:.3f} s, save {c.save_s:.3f} s, restart {c.restart_s:.2f} s "
                "(means), redo half an interval and a save"
            )
        else:
            base, src = m.base_step(r)
            c = FtCosts(base, r.lost_s or 0.0, r.out_s or 0.0, meta.groups)
            pred = wall_ft(c, meta.steps, r.failures)
            inputs = f"step {base:.3f} s ({src}), lost {c.stall_s:.2f} s per failure (mean)"
        err = 100 * (pred / r.time_to_n - 1)
        out.append(f"{r.name:<22}{r.time_to_n:>11.1f}{pred:>9.1f}{err:>+7.1f}%  {inputs}")
    return out


def projection(m: Measured, cl: Cluster) -> list[str]:
    """ETTR per way at the published failure rates, from this run's costs and ``cl``."""
    ck = next((r for r in m.rows if r.save_every), None)
    fts = [r for r in m.rows if not r.save_every]
    head = f"{'GPUs':>8}{'MTBF':>9}" + (f"{'ckpt-restart':>20}" if ck else "")
    out = [head + "".join(f"{r.name:>17}" for r in fts)]
    for sc in PUBLISHED:
        line = f"{sc.gpus:>8}{sc.mtbf_s / 3600:>8.2f}h"
        if ck:
            fixed = (ck.restart_s or 0.0) - (ck.load_s or 0.0)
            e, tau = at_scale_ckpt(cl, fixed, sc)
            line += f"{e:>11.3f} (τ {tau:>3.0f} s)"
        for r in fts:
            base, _ = m.base_step(r)
            costs = MeasuredFt(
                # Negative costs (a dead group freed this machine's CPU) are not carried to scale.
                max(0.0, base - m.ideal_s),
                max(0.0, r.lost_s or 0.0),
                r.out_s or 0.0,
                "warm" in r.name,
            )
            line += f"{at_scale_ft(cl, costs, sc):>17.3f}"
        out.append(line)
    return out


def _ratios(m: Measured) -> None:
    ckpt = next((r for r in m.rows if r.save_every), None)
    ref = next((r for r in m.rows if r.name.startswith("torchft")), None)
    for r in m.rows:
        if r.save_every:
            continue
        f = m.free.get(r.name.split()[0])
        parts = [f"{r.name}:"]
        if f:
            parts.append(f"time to N / its failure-free time {r.time_to_n / f.time_to_n:.3f};")
        if ckpt:
            parts.append(
                f"checkpoint-and-restart took {ckpt.time_to_n / r.time_to_n:.2f}x as long;"
            )
        if ref and r is not ref:
            parts.append(f"{ref.name} took {ref.time_to_n / r.time_to_n:.3f}x as long")
        print(" ".join(parts).rstrip(";"))


def report(meta: Meta, runs: list[WayRun], cl: Cluster, chart_path: Path | None) -> None:
    """Prints the table, the per-event costs, the model's check and its projection."""
    free = {r.name.split()[0]: stats(r, meta.groups) for r in runs if r.name.endswith(FREE)}
    rows = [stats(r, meta.groups) for r in runs if not r.name.endswith(FREE)]
    ckpt = next((r for r in rows if r.save_every), None)
    # The ideal step: the fastest failure-free measurement of the same work. Plain DDP's moves
    # with the load other processes put on a shared machine between runs.
    same = [f.time_to_n / (meta.steps - 1) for f in free.values() if f.samples_lost <= SAME_WORK]
    ideal = min([meta.ideal_step_s, *([ckpt.step_s] if ckpt else []), *same])
    m = Measured(rows, free, ideal, meta.steps)
    print(
        f"\nversus: {meta.groups} ranks, {meta.steps} steps, MTBF {meta.mtbf:.0f} s (SIGKILL of "
        f"one rank); ideal step {m.ideal_s:.3f} s (the fastest failure-free step of the same work; "
        f"{meta.compute_s:.2f} s of it simulated accelerator); calibration (plain DDP): step {meta.ideal_step_s:.3f} s, DCP save {meta.save_s:.3f} s, "
        f"so a save every K={meta.save_every} steps"
    )
    band = abs(ckpt.final_loss - ckpt.noise_loss) if ckpt and ckpt.noise_loss else None
    th_free = free.get("torchheal")
    for line in table(rows + list(free.values()), m.ideal_s, meta.steps, th_free, band):
        print(line)
    _ratios(m)
    print(
        "\nper-event costs, mean per failure (s). ckpt: restart = kill -> first step again less a "
        "step, detect = kill -> new ranks start. ft: stall = job time lost in the 5 s after the "
        "kill (detection, reconfiguration), lost = until the next kill or step N (the rejoin and "
        "all), out = kill -> the victim commits again"
    )
    for r in rows:
        if r.save_every:
            print(
                f"  {r.name:<22} restart {r.restart_s or 0:.2f}  detect+teardown "
                f"{r.detect_s or 0:.2f}  load {r.load_s or 0:.3f}  save {r.save_s or 0:.3f}"
            )
        else:
            print(
                f"  {r.name:<22} stall {r.stall_s or 0:.2f}  lost {r.lost_s or 0:.2f}  out "
                f"{r.out_s or 0:.2f}  step {r.step_s:.3f} (median {r.median_step_s:.3f})"
            )
    print("\nmodel check (bench/versus_model.py), time to N:")
    for line in model_check(meta, m):
        print("  " + line)
    print(
        f"\nprojection (ETTR over samples; ideal = a failure-free step of {cl.step_s:.0f} s with no "
        f"fault-tolerance cost): {cl.params / 1e9:.0f}B parameters x {cl.bytes_per_param:.0f} B = "
        f"{cl.state_gb:.0f} GB of state, replica groups of {cl.group_gpus} GPUs, checkpoint "
        f"{cl.ckpt_gbps:.0f} GB/s, heal {cl.heal_gbps:.0f} GB/s per GPU, relaunch "
        f"{cl.relaunch_s:.0f} s (assumed); per-step overhead, lost time per failure, restarts and "
        "detection as measured above"
    )
    for line in projection(m, cl):
        print("  " + line)
    if chart_path is not None:
        title = f"{meta.groups} ranks to step {meta.steps}, MTBF {meta.mtbf:.0f} s"
        made = chart(runs, chart_path, title)
        if made:
            print(f"\nchart: {made}")


def measure(args: argparse.Namespace, out: Path) -> tuple[Meta, list[WayRun]]:
    """Calibrates, then runs every way of ``args.ways`` (and the failure-free baseline) on one
    trace; keeps the trace, the runs and their logs in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    trace = (
        load_trace(Path(args.trace), args.groups)
        if args.trace
        else make_trace(args.seed, args.mtbf, args.groups)
    )
    (out / "trace.txt").write_text("".join(f"{t} {v}\n" for t, v in trace))
    step_s, save_s = calibrate(args, out)
    k = args.save_every or max(1, round(young_interval(save_s, args.mtbf) / step_s))
    meta = Meta(args.groups, args.steps, args.mtbf, step_s, save_s, k, args.compute_s)
    (out / "meta.json").write_text(json.dumps(asdict(meta)))
    print(f"calibration: step {step_s:.3f} s, save {save_s:.3f} s -> K = {k}", file=sys.stderr)
    todo = [w for w in args.ways.split(",") if w]
    if not reference_available():
        skipped = [w for w in todo if w.startswith("torchft")]
        todo = [w for w in todo if w not in skipped]
        if skipped:
            print(f"not run (the reference is not installed): {', '.join(skipped)}")
    runs = []
    for way in todo:
        runs.append(run_way(way, args, trace, k, out))
        runs[-1].save(out / f"run-{len(runs) - 1}.json")
    for impl in [i for i in args.free.split(",") if i]:
        if impl == "torchft" and not reference_available():
            continue
        runs.append(run_ft(args, [], impl, "cold", out, f"{impl} {FREE}"))
        runs[-1].save(out / f"run-{len(runs) - 1}.json")
    return meta, runs


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=3, help="ranks (ckpt) = replica groups (ft)")
    p.add_argument("--steps", type=int, default=800, help="N")
    p.add_argument("--mtbf", type=float, default=25.0, help="mean seconds between failures")
    p.add_argument("--seed", type=int, default=0, help="of the failure trace")
    p.add_argument("--trace", default=None, help="a file of 'seconds victim' lines instead")
    p.add_argument("--save-every", type=int, default=0, help="K (default: Young's rule)")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated of {', '.join(WAYS)}")
    p.add_argument(
        "--free", default="torchheal,torchft", help="libraries also run without failures ('' none)"
    )
    p.add_argument("--compute-s", type=float, default=0.2, help="simulated accelerator s per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--cal-steps", type=int, default=60, help="steps of the calibration run")
    p.add_argument("--deadline", type=float, default=1200.0, help="seconds a way may take")
    p.add_argument("--out", default=None, help="keep events, logs and runs here")
    p.add_argument("--chart", default=None, help="PNG path (default: versus.png in --out, or none)")
    p.add_argument("--report", default=None, help="print the tables of the runs kept in DIR")
    g = p.add_argument_group("projection (assumed at scale)")
    d = Cluster()
    g.add_argument("--params", type=float, default=d.params)
    g.add_argument("--bytes-per-param", type=float, default=d.bytes_per_param)
    g.add_argument("--group-gpus", type=int, default=d.group_gpus)
    g.add_argument("--scale-step-s", type=float, default=d.step_s)
    g.add_argument("--ckpt-gbps", type=float, default=d.ckpt_gbps)
    g.add_argument("--heal-gbps", type=float, default=d.heal_gbps)
    g.add_argument("--relaunch-s", type=float, default=d.relaunch_s)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    cl = Cluster(
        args.params,
        args.bytes_per_param,
        args.group_gpus,
        args.scale_step_s,
        args.ckpt_gbps,
        args.heal_gbps,
        args.relaunch_s,
    )
    if args.report:
        kept = Path(args.report)
        meta = Meta(**json.loads((kept / "meta.json").read_text()))
        runs = [WayRun.load(p) for p in sorted(kept.glob("run-*.json"))]
        report(meta, runs, cl, Path(args.chart) if args.chart else kept / "versus.png")
        return
    print(f"load average before: {os.getloadavg()}", flush=True)
    ctx = contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory()
    with ctx as out_dir:
        out = Path(out_dir)
        meta, runs = measure(args, out)
        chart_path = Path(args.chart) if args.chart else (out / "versus.png" if args.out else None)
        report(meta, runs, cl, chart_path)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
