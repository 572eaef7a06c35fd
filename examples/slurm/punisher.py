#!/usr/bin/env python3
"""Inject failures into a torchheal job on Slurm: cancel random replica groups on a schedule.

    python examples/slurm/punisher.py kill_loop --num-failures 10 --mtbf-secs 300
    python examples/slurm/punisher.py kill_one
    python examples/slurm/punisher.py kill_all

``kill_one`` cancels one running replica group, never group 0 (so the job always keeps a group
that never failed); ``kill_loop`` does that ``--num-failures`` times, waiting a random time
between failures, uniform in [0, 2 x ``--mtbf-secs``] (mean: the MTBF); ``kill_all`` cancels
every group. ``runner.py`` submits the cancelled groups again and they heal from the others.

Fixed from the reference: the loop really waits the random delay (the reference computed it,
printed it and slept the MTBF); ``kill_one`` with no candidate says so instead of crashing.
``--seed`` makes a schedule reproducible.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm import Job, cancel, group_jobs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job-prefix", default="torchheal_ft", help="job names: PREFIX_<group>")
    parser.add_argument("--seed", type=int, default=None, help="seed the random choices")
    commands = parser.add_subparsers(dest="command", required=True)
    loop = commands.add_parser("kill_loop", help="cancel a random group, wait, repeat")
    loop.add_argument(
        "--mtbf-secs", type=float, default=5.0, help="mean time between failures (default 5)"
    )
    loop.add_argument("--num-failures", type=int, default=1, help="failures to inject (default 1)")
    commands.add_parser("kill_one", help="cancel one random running group (never group 0)")
    commands.add_parser("kill_all", help="cancel every group")
    args = parser.parse_args(argv)
    if args.command == "kill_loop":
        if args.mtbf_secs <= 0:
            parser.error("--mtbf-secs must be positive")
        if args.num_failures < 1:
            parser.error("--num-failures must be at least 1")
    return args


def delays(num_failures: int, mtbf_s: float, rng: random.Random) -> list[float]:
    """The waits after each failure: uniform in [0, 2 x MTBF], so their mean is the MTBF.

    Args:
        num_failures: how many failures.
        mtbf_s: the mean time between failures, seconds.
        rng: the random source.
    """
    return [rng.uniform(0.0, 2.0 * mtbf_s) for _ in range(num_failures)]


def kill_one(prefix: str, rng: random.Random, out: Callable[[str], None] = print) -> Job | None:
    """Cancels one running replica group other than group 0.

    Args:
        prefix: the groups' job-name prefix.
        rng: the random source.
        out: where the report goes.

    Returns:
        The cancelled job, or None when no group could be chosen.
    """
    running = group_jobs(prefix, frozenset({"RUNNING"}))
    candidates = sorted(
        (job for group, jobs in running.items() if group != 0 for job in jobs),
        key=lambda j: j.name,
    )
    if not candidates:
        out(f"no running group to kill (besides group 0) among {prefix}_* jobs")
        return None
    choice = rng.choice(candidates)
    out(f"killing {choice.name} (job {choice.job_id}) of {[j.name for j in candidates]}")
    cancel(choice)
    return choice


def kill_all(prefix: str, out: Callable[[str], None] = print) -> list[Job]:
    """Cancels every replica group, queued or running.

    Args:
        prefix: the groups' job-name prefix.
        out: where the report goes.
    """
    killed = [job for jobs in group_jobs(prefix).values() for job in jobs]
    for job in killed:
        out(f"killing {job.name} (job {job.job_id})")
        cancel(job)
    return killed


def kill_loop(
    prefix: str,
    num_failures: int,
    mtbf_s: float,
    rng: random.Random,
    sleep: Callable[[float], None] = time.sleep,
    out: Callable[[str], None] = print,
) -> list[Job | None]:
    """Cancels a random group, waits a random delay, ``num_failures`` times.

    Args:
        prefix: the groups' job-name prefix.
        num_failures: how many failures.
        mtbf_s: the mean time between failures, seconds.
        rng: the random source.
        sleep: how to wait.
        out: where the report goes.
    """
    killed = []
    for i, delay in enumerate(delays(num_failures, mtbf_s, rng)):
        killed.append(kill_one(prefix, rng, out))
        if i + 1 < num_failures:
            out(f"next failure in {delay:.1f}s (mean {mtbf_s:g}s)")
            sleep(delay)
    return killed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    try:
        if args.command == "kill_loop":
            kill_loop(args.job_prefix, args.num_failures, args.mtbf_secs, rng)
        elif args.command == "kill_one":
            kill_one(args.job_prefix, rng)
        else:
            kill_all(args.job_prefix)
    except RuntimeError as e:
        print(f"slurm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
