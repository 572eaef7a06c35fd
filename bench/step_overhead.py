"""Step overhead of fault tolerance: fault-tolerant DDP vs stock torch DDP (and the reference).

Two replica groups of one rank each, Gloo on loopback, a ~5M-parameter MLP, batch 32, SGD.
Each configuration runs as separate processes; steps/s is measured on every group after a
warm-up and averaged. Goal: torchheal within 5% of plain DDP and at least the reference.

    python -m bench.step_overhead [--steps 120] [--warmup 20] [--rounds 2] [--phases]
                                  [--malloc glibc|steady] [--salvage] [--guard]

``--guard`` adds torchheal with the divergence guard off, checking every 10 steps and every step
(the plain torchheal row runs it at its default, every 100 steps): what comparing the groups'
state fingerprints costs (docs/divergence.md). The default's cost is far below the run-to-run
noise of steps/s, so the table also gives it from the rows' step times: the guard works only at
the steps it compares, so its cost per comparison is ``(every step - off)`` and the default's is a
hundredth of that per step; the every-10 row checks that the cost grows with the comparisons.

``--salvage`` adds torchheal with ``Manager(salvage_step=True)``: what keeping a copy of every
allreduce's input costs a step (the price of committing the step a group dies in).

On CPU the step's gradients (18 MB here) are freed by ``zero_grad`` and allocated again by the
next backward. glibc's malloc gives the top of its heap back to the system when more than its
trim threshold is free there, and whether the freed gradients reach that threshold depends on
where they happen to lie in the heap: in some processes every step then maps and zeroes the
gradients' pages again (about 4,700 page faults, 8-10 ms of CPU per step on the 2-core machine
this was written on), in others never, whichever library runs the loop (a bare loop without DDP
does it every step). ``--phases`` prints the training thread's page faults per step so a table
shows when this happened. ``--malloc steady`` gives every configuration's workers the same
fixed thresholds (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), which takes the
allocator's layout out of the comparison; the default measures what a user gets.
"""

from __future__ import annotations

import argparse
import statistics

import torch.distributed as dist

from bench._cluster import lighthouse, reference_available, run_workers
from torchheal.launcher import RunResult


def steps_per_second(result: RunResult, warmup: int) -> float:
    rates = []
    for g in result.groups:
        times = [
            e.time
            for e in result.events
            if e.kind == "step" and e.group == g and e.fields.get("committed")
        ]
        times = times[warmup:]
        if len(times) >= 2:
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    if not rates:
        raise RuntimeError("no committed steps measured; rerun with BENCH_VERBOSE=1")
    return statistics.mean(rates)


def phase_medians(result: RunResult, warmup: int) -> dict[str, float]:
    """Median milliseconds per phase over the measured committed steps of every group."""
    spans: dict[str, list[float]] = {}
    for g in result.groups:
        steps = [
            e
            for e in result.events
            if e.kind == "step" and e.group == g and e.fields.get("committed")
        ][warmup:]
        for e in steps:
            for name, ms in e.fields.get("phases", {}).items():
                spans.setdefault(name, []).append(ms)
    return {name: statistics.median(v) for name, v in spans.items()}


#: Fixed glibc malloc thresholds for ``--malloc steady``: blocks under 32 MiB (glibc's largest
#: dynamic threshold) come from the heap, and the heap keeps up to 1 GiB free at its top.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def thread_cpu_per_step(result: RunResult, steps: int) -> dict[str, float]:
    """CPU milliseconds per measured step by thread name, summed over the groups (``--phases``)."""
    cpu: dict[str, float] = {}
    for e in result.events:
        if e.kind == "done":
            for name, seconds in e.fields.get("thread_cpu", {}).items():
                cpu[name] = cpu.get(name, 0.0) + seconds * 1e3 / steps
    return cpu


def main_thread_faults_per_step(result: RunResult, steps: int) -> list[float]:
    """Minor page faults of each group's training thread per measured step (``--phases``)."""
    return [
        e.fields.get("thread_faults", {}).get("MainThread", 0) / steps
        for e in result.events
        if e.kind == "done"
    ]


#: torchheal with ``Manager(salvage_step=True)`` (``TORCHHEAL_SALVAGE_STEP=1``).
SALVAGE = "torchheal+salvage"
#: torchheal with the divergence guard off and every step (the plain row: every 100 steps).
GUARD_OFF = "torchheal+guard-off"
GUARD_TEN = "torchheal+guard-every-10"
GUARD_EVERY = "torchheal+guard-every-step"
GUARD_INTERVAL = {GUARD_OFF: "0", GUARD_TEN: "10", GUARD_EVERY: "1"}
#: The guard's default interval (what the plain torchheal row runs).
DEFAULT_INTERVAL = 100


def print_guard_cost(
    results: dict[str, list[float]], phases: dict[str, list[dict[str, float]]], impls: list[str]
) -> None:
    """The guard's cost per comparison, and what it makes of each interval: predicted from the
    comparisons, and measured directly where the row ran (within the steps/s noise)."""
    ms = {i: 1e3 / statistics.median(results[i]) for i in impls if i in results}
    off = ms[GUARD_OFF]
    per_check = ms[GUARD_EVERY] - off
    how = "every step - off, steps/s"
    if phases[GUARD_EVERY] and phases[GUARD_OFF][0]:
        # The guard works in the vote only: its phase is far less noisy than a whole step.
        def vote(impl: str) -> float:
            return statistics.median(p.get("vote", 0.0) for p in phases[impl])

        per_check = vote(GUARD_EVERY) - vote(GUARD_OFF)
        how = "every step - off, vote phase"
    print(f"\nguard: {per_check:.2f} ms per comparison ({how}) on a {off:.2f} ms step")
    print(f"{'interval':<10}{'predicted cost':>16}{'measured cost':>15}")
    rows = {DEFAULT_INTERVAL: "torchheal", 10: GUARD_TEN, 1: GUARD_EVERY}
    for interval, impl in rows.items():
        measured = f"{(ms[impl] - off) / off:>14.2%}" if impl in ms else f"{'-':>14}"
        print(f"{interval:<10}{per_check / interval / off:>16.3%} {measured}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--rounds", type=int, default=2, help="repeat each configuration, interleaved"
    )
    parser.add_argument(
        "--phases", action="store_true", help="also print the median time of each step phase"
    )
    parser.add_argument(
        "--malloc",
        choices=["glibc", "steady"],
        default="glibc",
        help="glibc: the allocator's defaults; steady: the same fixed thresholds for everyone",
    )
    parser.add_argument(
        "--bucket-view",
        action="store_true",
        help="every configuration's DDP with gradient_as_bucket_view=True",
    )
    parser.add_argument(
        "--salvage",
        action="store_true",
        help="also torchheal with Manager(salvage_step=True): the cost of keeping each "
        "allreduce's input",
    )
    parser.add_argument(
        "--guard",
        action="store_true",
        help="also torchheal with the divergence guard off and every step",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["plain", "torchheal", SALVAGE, GUARD_OFF, GUARD_TEN, GUARD_EVERY, "torchft"],
        help="configurations",
    )
    args = parser.parse_args()
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    worker_args += ["--phases"] if args.phases else []
    worker_args += ["--bucket-view"] if args.bucket_view else []
    impls = ["plain", "torchheal"] + ([SALVAGE] if args.salvage or args.only else [])
    impls += [GUARD_OFF, GUARD_TEN, GUARD_EVERY] if args.guard or args.only else []
    impls += ["torchft"] if reference_available() else []
    if args.only:
        impls = [i for i in impls if i in args.only]
    results: dict[str, list[float]] = {i: [] for i in impls}
    phases: dict[str, list[dict[str, float]]] = {i: [] for i in impls}
    cpu: dict[str, list[dict[str, float]]] = {i: [] for i in impls}
    faults: dict[str, list[float]] = {i: [] for i in impls}
    malloc_env = STEADY_MALLOC if args.malloc == "steady" else {}
    for r in range(args.rounds):
        # Interleaved, and each round in another order, so a slow spell of the (shared)
        # machine does not fall on one configuration only.
        for impl in impls[r % len(impls) :] + impls[: r % len(impls)]:
            if impl == "plain":
                store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                env = {
                    "PLAIN_STORE_HOST": "127.0.0.1",
                    "PLAIN_STORE_PORT": str(store.port),
                    **malloc_env,
                }
                result = run_workers("plain", 2, "http://unused:1", worker_args, env=env)
                del store
            else:
                library = impl.split("+")[0]
                salvage = {
                    "TORCHHEAL_SALVAGE_STEP": "1" if impl == SALVAGE else "0",
                    "TORCHHEAL_DIVERGENCE_CHECK_INTERVAL": GUARD_INTERVAL.get(
                        impl, str(DEFAULT_INTERVAL)
                    ),
                }
                with lighthouse(library) as addr:
                    env = {**malloc_env, **salvage}
                    result = run_workers(library, 2, addr, worker_args, env=env)
            assert not result.timed_out, f"{impl} run timed out"
            results[impl].append(steps_per_second(result, args.warmup))
            phases[impl].append(phase_medians(result, args.warmup))
            cpu[impl].append(thread_cpu_per_step(result, args.steps - args.warmup))
            faults[impl].extend(main_thread_faults_per_step(result, args.steps - args.warmup))

    base = statistics.median(results[impls[0]])
    print(
        f"\nStep overhead: 2 replica groups x 1 rank, Gloo, ~5M-param MLP, {args.steps} steps"
        f" ({args.warmup} warm-up), median of {args.rounds} interleaved rounds,"
        f" malloc {args.malloc}{', gradient_as_bucket_view' if args.bucket_view else ''}"
    )
    print(f"{'configuration':<26}{'steps/s':>10}{'min':>8}{'max':>8}{'vs ' + impls[0]:>16}")
    names = {
        "plain": "plain torch DDP",
        "torchheal": "torchheal FT DDP",
        SALVAGE: "torchheal + salvage_step",
        GUARD_OFF: "torchheal, guard off",
        GUARD_TEN: "torchheal, guard every 10",
        GUARD_EVERY: "torchheal, guard every step",
        "torchft": "torchft (reference) FT DDP",
    }
    for impl in impls:
        rates = results[impl]
        rate = statistics.median(rates)
        print(
            f"{names[impl]:<26}{rate:>10.2f}{min(rates):>8.2f}{max(rates):>8.2f}"
            f"{rate / base:>15.3f}x"
        )
    if GUARD_OFF in impls and GUARD_EVERY in impls:
        print_guard_cost(results, phases, impls)
    if args.phases:
        print("\nmedian ms per phase (median over rounds)")
        cols = ["start", "forward", "backward", "vote", "update"]
        print(f"{'configuration':<26}" + "".join(f"{c:>10}" for c in cols))
        for impl in impls:
            row = [statistics.median(p.get(c, 0.0) for p in phases[impl]) for c in cols]
            print(f"{names[impl]:<26}" + "".join(f"{v:>10.2f}" for v in row))
        print("\nCPU ms per step by thread (both groups, median over rounds)")
        for impl in impls:
            threads = sorted({t for c in cpu[impl] for t in c})
            per = {t: statistics.median(c.get(t, 0.0) for c in cpu[impl]) for t in threads}
            total = sum(per.values())
            top = sorted(per.items(), key=lambda kv: -kv[1])[:8]
            print(
                f"{names[impl]:<26}{total:>8.2f} total: "
                + ", ".join(f"{t} {v:.2f}" for t, v in top)
            )
        print("\ntraining thread's page faults per step (each group of each round)")
        for impl in impls:
            print(f"{names[impl]:<26}" + " ".join(f"{v:.0f}" for v in faults[impl]))


if __name__ == "__main__":
    main()
