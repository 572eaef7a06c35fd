"""Recovery time: SIGKILL one of two replica groups, restart it, and time both sides.

Reports, per implementation and state size: seconds until the survivor commits again after the
kill, and seconds from the restart to the restarted group's first commit (which includes its
process start, joining the quorum and receiving the whole state live). Same lighthouse settings
for both implementations (the reference's defaults: heartbeat timeout 5 s, join timeout 100 ms).

Then the rejoin, phase by phase (``bench/_rejoin.py``: 2 groups, an MLP of ~5.2M parameters
with AdamW, ~57 MB of state plus ``--sizes`` of ballast): the restarted process's start-up
(interpreter, torch and the library's imports), the rest up to its first commit, its Manager's
construction to its first commit, its receive of the state (torchheal's timeline) against a raw
loopback socket copy of the same bytes measured in the same run, and the survivor's longest step
from the healer's Manager construction to its fifth commit against its normal step. Last, for
torchheal, where the healer's Manager -> first commit went, phase by phase on its critical path
(``bench/_rejoin.py``'s ``CRITICAL_PATH``: construction, warm-up, quorum, metadata, waiting for the
source, transfer, load, vote and optimizer step).

    python -m bench.recovery [--sizes 100,1000] [--transport http] [--rejoin-runs 3]
    python -m bench.recovery --rejoin-only --sizes 0 --rejoin-runs 3
"""

from __future__ import annotations

import argparse
import statistics

from bench._cluster import lighthouse, reference_available, run_workers
from bench._rejoin import CRITICAL_PATH, Rejoin, critical_path, run_rejoin
from bench.transport import raw_socket
from torchheal.launcher import KillPlan
from torchheal.launcher.demo.summary import summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="extra state in MB, comma-separated")
    parser.add_argument("--transport", choices=["http", "pg"], default="http")
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    parser.add_argument("--rejoin-runs", type=int, default=1, help="rejoins per implementation")
    parser.add_argument("--rejoin-only", action="store_true", help="only the rejoin table")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="rejoin with each group on a CPU of its own (as on separate machines)",
    )
    args = parser.parse_args()
    impls = ["torchheal"] + (["torchft"] if reference_available() else [])
    sizes = [int(s) for s in args.sizes.split(",")]
    if not args.rejoin_only:
        recovery_table(args, impls, sizes)
    rejoin_table(args, impls, sizes)


def recovery_table(args: argparse.Namespace, impls: list[str], sizes: list[int]) -> None:
    """Kill and restart through the launcher: survivor's resume, restart to first commit."""
    rows = []
    for size in sizes:
        for impl in impls:
            with lighthouse(impl, heartbeat_timeout_ms=args.heartbeat_timeout_ms) as addr:
                result = run_workers(
                    impl,
                    2,
                    addr,
                    [
                        "--steps",
                        str(args.steps),
                        "--state-mb",
                        str(size),
                        "--transport",
                        args.transport,
                        # The survivor trains on until the restart has healed back in.
                        "--until-full",
                        "2",
                    ],
                    kill_plan=KillPlan(at_step=args.kill_at, victims=(1,), max_kills=1),
                )
            s = summarize(result)
            r = s.recoveries[0] if s.recoveries else None
            rows.append(
                (
                    impl,
                    size,
                    r.survivor_stall_s if r else None,
                    r.rejoin_s if r else None,
                    r.healed if r else False,
                    result.timed_out,
                )
            )

    def fmt(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "n/a"

    print(
        f"\nRecovery: 2 groups, SIGKILL group 1 at step {args.kill_at}, {args.transport} transport, heartbeat timeout {args.heartbeat_timeout_ms} ms"
    )
    print(
        f"{'implementation':<16}{'state MB':>9}{'survivor resumes (s)':>23}{'restart->first commit (s)':>28}{'healed':>8}"
    )
    for impl, size, stall, rejoin, healed, timed_out in rows:
        print(
            f"{impl:<16}{size:>9}{fmt(stall):>23}{fmt(rejoin):>28}{('yes' if healed else 'no') + (' (timed out)' if timed_out else ''):>8}"
        )


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def rejoin_table(args: argparse.Namespace, impls: list[str], sizes: list[int]) -> None:
    """The rejoin phase by phase, implementations alternating, medians of ``--rejoin-runs``."""
    results: dict[tuple[str, int], list[Rejoin]] = {}
    raw: dict[int, list[float]] = {}
    for size in sizes:
        for _ in range(args.rejoin_runs):
            for impl in impls:
                r = run_rejoin(
                    impl, state_mb=size, transport=args.transport, timeline=True, pin=args.pin
                )
                results.setdefault((impl, size), []).append(r)
                if r.transfer_bytes:
                    # The wire's ceiling for the same bytes, measured now, between the runs.
                    times = raw_socket(r.transfer_bytes, 3)
                    raw.setdefault(size, []).append(r.transfer_bytes / min(times))

    def fmt(x: float | None, spec: str = ".2f") -> str:
        return format(x, spec) if x is not None else "n/a"

    print(
        f"\nRejoin of 1 of 2 groups ({args.transport} transport, AdamW MLP ~57 MB of state + "
        f"ballast{', each group on a CPU of its own' if args.pin else ''}), medians of "
        f"{args.rejoin_runs} run(s); seconds unless noted"
    )
    head = (
        f"{'impl':<10}{'ballast':>8}{'start+imports':>14}{'rest->commit':>13}"
        f"{'Manager->commit':>16}{'transfer':>9}{'MB':>5}{'GB/s':>6}{'raw GB/s':>9}"
        f"{'/raw':>6}{'M->c - xfer':>12}{'normal step':>12}{'survivor max':>13}{'x':>6}"
        f"{'healed':>7}"
    )
    print(head)
    by_impl: dict[str, dict[int, float | None]] = {}
    for (impl, size), runs in results.items():
        transfer = _median([r.transfer_s for r in runs])
        nbytes = next((r.transfer_bytes for r in runs if r.transfer_bytes), None)
        gbps = nbytes / transfer / 1e9 if nbytes and transfer else None
        raw_gbps = statistics.median(raw[size]) / 1e9 if raw.get(size) else None
        m2c = _median([r.manager_to_commit_s for r in runs])
        normal = statistics.median(r.normal_step_s for r in runs)
        worst = _median([r.survivor_max_s for r in runs])
        rest = _median([r.rest_s for r in runs])
        by_impl.setdefault(impl, {})[size] = rest
        print(
            f"{impl:<10}{size:>8}{fmt(_median([r.startup_s for r in runs])):>14}"
            f"{fmt(rest):>13}{fmt(m2c):>16}{fmt(transfer, '.3f'):>9}"
            f"{fmt(nbytes / 1e6 if nbytes else None, '.0f'):>5}{fmt(gbps):>6}"
            f"{fmt(raw_gbps):>9}{fmt(gbps / raw_gbps if gbps and raw_gbps else None):>6}"
            f"{fmt(m2c - transfer if m2c is not None and transfer is not None else None, '.3f'):>12}"
            f"{fmt(normal, '.3f'):>12}{fmt(worst, '.3f'):>13}"
            f"{fmt(worst / normal if worst else None):>6}"
            f"{f'{sum(r.healed for r in runs)}/{len(runs)}':>7}"
        )
    path_table(results)
    if "torchft" in by_impl:
        for size in sizes:
            ours, ref = by_impl["torchheal"].get(size), by_impl["torchft"].get(size)
            if ours and ref:
                print(
                    f"ballast {size} MB: restart->first commit without start-up, torchheal / "
                    f"reference = {ours / ref:.2f} (goal <= 0.5)"
                )


def path_table(results: dict[tuple[str, int], list[Rejoin]]) -> None:
    """Where torchheal's Manager -> first commit goes, phase by phase (medians, ms)."""
    rows = []
    for (impl, size), runs in results.items():
        paths = [p for p in map(critical_path, runs) if p is not None]
        if paths:
            medians = [statistics.median(p[i][1] for p in paths) for i in range(len(CRITICAL_PATH))]
            rows.append((impl, size, len(paths), medians))
    if not rows:
        return
    print(
        "\nThe healer's Manager -> first commit on its critical path, phase by phase (ms, medians "
        "of the runs that healed after a warm-up; each phase begins where the one before ended; "
        "its heal step's forward and backward and the source's staging run beside them)"
    )
    names = [name for name, _ in CRITICAL_PATH]
    print(
        f"{'impl':<10}{'ballast':>8}{'runs':>5}"
        + "".join(f"{n:>{max(9, len(n) + 1)}}" for n in names)
    )
    for impl, size, n, medians in rows:
        cells = "".join(
            f"{1000 * m:>{max(9, len(name) + 1)}.1f}"
            for name, m in zip(names, medians, strict=True)
        )
        print(f"{impl:<10}{size:>8}{n:>5}{cells}")


if __name__ == "__main__":
    main()
