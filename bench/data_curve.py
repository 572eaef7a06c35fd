"""The data plan against the reference's data handling, on the DDP example's model (issue 44).

Three replica groups (one process each, Gloo, CPU) train ``examples/train_ddp.py``'s CNN on its
synthetic dataset for ``--steps`` steps against a lighthouse (``min_replicas=1``, join 100 ms,
heartbeat timeout 1 s); each step sleeps 0.1 s more (the rest of a real step's compute), so a
restarted group (a cold start: several seconds) is back within some tens of steps. Four runs, each with the same seed and initial weights:

* ``plan``: the data plan with a constant global batch ``B`` (``--global-batch``), no failure;
* ``plan+faults``: the same with faults: group 1 SIGKILLed (and restarted) at step S/8, group 2
  frozen 3 s at 3S/8, group 0 SIGKILLed (and restarted) at 5S/8, each after its quorum and
  before its forward pass (so the step in flight fails and is redone without it);
* ``sampler`` and ``sampler+faults``: the reference's default data handling (torchft's
  ``DistributedSampler``: each group its own shard, ``B/3`` samples per step, lossy; a
  restarted group's loader starts its shard again);
* ``plan, micro-batch 16``: the plan without failures, micro-batches of 16 instead of 48: the
  same samples per step summed in another order, so its distance from ``plan`` is what
  floating-point noise alone does (training amplifies a last-bit difference step by step).

The failure-free runs go as far as their faulty run went (a fault waits for a step with every
group in, so the faults may land past ``--steps``).

Per committed step the job's loss is the sum of the contributing groups' per-sample losses
over the samples they read (each group reports its own, computed before the step's update).
Printed: per run, steps, steps without every group, samples per step (min-max), samples read
twice and positions skipped, and the largest loss difference from its failure-free run. The
plot (``--plot``, default ``docs/data_curve.png``) shows the four loss curves and, below, each
faulty run's distance from its failure-free run, and the control's.

    python -m bench.data_curve [--steps 120] [--plot docs/data_curve.png]   (~10 min on 2 cores)
    python -m bench.data_curve --plan-cost                                  (~5 s)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = 3


def faults_for(steps: int) -> dict[int, list[str]]:
    return {
        1: ["--kill-at", str(steps // 8)],
        2: ["--freeze-at", str(3 * steps // 8), "--freeze-s", "3"],
        0: ["--kill-at", str(5 * steps // 8)],
    }


def run(
    data: str,
    faulty: bool,
    steps: int,
    batch: int,
    out: Path,
    deadline_s: float,
    extra: tuple[str, ...] = (),
) -> list:
    """One job; returns every attempt's record."""
    from torchheal.coordination import LighthouseServer

    out.mkdir(parents=True, exist_ok=True)
    if (out / "done").exists():  # --out of an earlier run: read its records again
        return load(out)
    lh = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000
    )
    faults = faults_for(steps) if faulty else {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(g: int, incarnation: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "bench._data_worker", "--group", str(g)]
        cmd += ["--groups", str(GROUPS), "--lighthouse", f"http://127.0.0.1:{lh.port()}"]
        cmd += ["--out-dir", str(out), "--data", data, "--steps", str(steps)]
        cmd += ["--global-batch", str(batch), "--incarnation", str(incarnation)]
        cmd += [*faults.get(g, []), "--faults", str(len(faults)), *extra]
        log = open(out / f"g{g}.log", "a")  # the child writes it
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = {g: start(g, 0) for g in range(GROUPS)}
    incarnations = dict.fromkeys(procs, 0)
    t0 = time.monotonic()
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"{data} run did not finish in {deadline_s}s (logs in {out})")
            for g, p in procs.items():
                code = p.poll()
                if code == -signal.SIGKILL and incarnations[g] == 0:
                    incarnations[g] += 1  # the planned kill: restart, as torchrun would
                    procs[g] = start(g, 1)
                elif code not in (None, 0):
                    raise RuntimeError(f"group {g} exited {code} (logs in {out})")
            time.sleep(0.2)  # a supervisor's poll, as torchrun's agent
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lh.shutdown()
    (out / "done").touch()
    return load(out)


def load(out: Path) -> list:
    return [json.loads(line) for g in range(GROUPS) for line in open(out / f"g{g}.jsonl")]


def fault_steps(records: list) -> list[int]:
    """Steps whose attempt with every group failed: where a fault struck."""
    failed = [r for r in records if r["after"] == r["before"] and r["participants"] == GROUPS]
    return sorted({r["before"] for r in failed})


def job_steps(records: list) -> list[list[dict]]:
    """Per committed step, up to where every group ended: the contributing groups' records of
    its commit. (A fault strikes only while every group is in, so no step is committed twice.)
    """
    final = min(max(r["after"] for r in records if r["group"] == g) for g in range(GROUPS))
    per: list[list[dict]] = [[] for _ in range(final)]
    for r in records:
        if r["after"] == r["before"] + 1 and r["rank"] is not None and r["before"] < final:
            per[r["before"]].append(r)
    return per


def summarize(name: str, records: list, steps: int, free: list[float] | None) -> dict:
    per = job_steps(records)[:steps]
    losses = [sum(r["loss_sum"] for r in rs) / max(1, sum(r["n"] for r in rs)) for rs in per]
    seen: dict[int, int] = {}
    for rs in per:
        for r in rs:
            for i in r["indices"]:
                seen[i] = seen.get(i, 0) + 1
    sizes = [sum(r["n"] for r in rs) for rs in per]
    short = sum(1 for rs in per if len(rs) < GROUPS)
    diff = max((abs(a - b) for a, b in zip(losses, free, strict=False)), default=0.0) if free else 0
    return {
        "name": name,
        "losses": losses,
        "steps": sum(1 for rs in per if rs),
        "short": short,
        "sizes": (min(sizes), max(sizes)),
        "twice": sum(1 for c in seen.values() if c > 1),
        "distinct": len(seen),
        "read": sum(sizes),
        "max_diff": diff,
    }


def plot(rows: list[dict], path: Path, batch: int, faults: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    styles = {
        "plan": ("tab:blue", "-"),
        "plan+faults": ("tab:orange", "--"),
        "sampler": ("tab:green", "-"),
        "sampler+faults": ("tab:red", "--"),
        "plan, micro-batch 16": ("tab:gray", ":"),
    }
    for row in rows:
        color, ls = styles[row["name"]]
        if row["name"].startswith("plan, "):
            continue  # the control's curve is the plan's: only its distance is drawn
        top.plot(row["losses"], color=color, ls=ls, lw=1.2, label=row["name"])
    top.set_ylabel("loss of the step's global batch")
    top.set_title(
        f"3 replica groups, kills, restarts and a frozen group (B = {batch}); "
        "grey lines: the plan run's faults"
    )
    top.legend()
    base = {r["name"]: r["losses"] for r in rows}
    pairs = (
        ("plan, micro-batch 16", "plan"),
        ("plan+faults", "plan"),
        ("sampler+faults", "sampler"),
    )
    for name, ref in pairs:
        if name in base and ref in base:
            d = [max(abs(a - b), 1e-12) for a, b in zip(base[name], base[ref], strict=False)]
            bottom.semilogy(d, color=styles[name][0], label=f"|{name} - {ref}|")
    for ax in (top, bottom):
        for step in faults:
            ax.axvline(step, color="black", lw=0.6, alpha=0.4)
    bottom.set_ylabel("distance from the failure-free run\n(1e-12: identical)")
    bottom.set_xlabel("committed step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plan_cost() -> None:
    """Per-step cost of the plan itself: one rank's share of a step (the order looked up
    sample by sample, sliced, cut into micro-batches)."""
    from torchheal.data import DataPlan, Order, StepKey, share

    print("| global batch | groups | samples per rank | micro-batch | us per step |")
    print("|---:|---:|---:|---:|---:|")
    for batch, k in ((96, 3), (1024, 3), (1024, 8), (8192, 8)):
        plan = DataPlan(10_000_000, batch, micro_batch=64, seed=0)
        order = Order(plan.dataset_size, plan.seed, plan.shuffle)
        counter = iter(range(10**9))

        def one() -> None:
            share(plan, StepKey(next(counter), k, 1), order=order)  # noqa: B023

        n = max(20, 20_000 // batch)
        best = min(timeit.repeat(one, number=n, repeat=5)) / n
        print(f"| {batch} | {k} | {batch // k} | 64 | {best * 1e6:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--plot", default=str(ROOT / "docs" / "data_curve.png"))
    p.add_argument(
        "--out", help="keep the runs' records and logs here (runs already there are read again)"
    )
    p.add_argument("--deadline-s", type=float, default=600.0)
    p.add_argument("--plan-cost", action="store_true", help="only time the plan")
    args = p.parse_args()
    if args.plan_cost:
        plan_cost()
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="data_curve_"))
    deadline = args.deadline_s
    rows: list[dict] = []
    faults: list[int] = []
    for data in ("plan", "sampler"):
        faulty = run(data, True, args.steps, args.global_batch, out / f"{data}+faults", deadline)
        # Faults wait for a full quorum, so they may land past --steps: the failure-free run
        # goes as far as the faulty one did.
        went = len(job_steps(faulty))
        free = run(data, False, went, args.global_batch, out / data, deadline)
        common = min(went, len(job_steps(free)))
        if data == "plan":
            faults = [s for s in fault_steps(faulty) if s < common]
        base = summarize(data, free, common, None)
        rows += [base, summarize(f"{data}+faults", faulty, common, base["losses"])]
        if data == "plan":
            # What floating-point noise alone does: no fault, the same samples per step, only
            # the summation order changed (micro-batches of 16 instead of 48).
            control = run(
                data,
                False,
                went,
                args.global_batch,
                out / "plan-control",
                deadline,
                ("--micro-batch", "16"),
            )
            rows.append(summarize("plan, micro-batch 16", control, common, base["losses"]))
    print(f"\nglobal batch {args.global_batch}, records in {out}\n")
    print(
        "| run | steps | steps without a group | samples per step | samples read (distinct) "
        "| read twice | max loss diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lo, hi = r["sizes"]
        diff = f"{r['max_diff']:.2e}" if r["name"] not in ("plan", "sampler") else "-"
        print(
            f"| {r['name']} | {r['steps']} | {r['short']} | {lo}-{hi} | {r['read']} "
            f"({r['distinct']}) | {r['twice']} | {diff} |"
        )
    plot(rows, Path(args.plot), args.global_batch, faults)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
