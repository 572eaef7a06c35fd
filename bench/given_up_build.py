"""A group left alone in a process-group build that its peers gave up: how long until it trains.

The scenario of ``tests/failfast/test_given_up_build.py`` (3 groups of the fail-fast tests'
worker, ``min_replicas=1``, join and tick 100 ms, the Managers' 60 s timeout, a 60 s heartbeat
timeout so that nobody expires): g1 and g2 give up their build of the quorum in which g2 joins
g0 and g1, and g0, alive, is left in that build's rendezvous. Reported per run: seconds from
the second give-up to each group's next commit. g0 comes back once told: by g1's or g2's report
of the build it gave up (``GaveUp``), or by the lighthouse once it issued a quorum without g0.
Without either notice it waited for its 60 s timeout (60.10 s, this scenario on the lighthouse
of stop 34).

The reference is not run: the torchft installed here builds its process groups from handles
exchanged through its lighthouse, and has no ``configure`` to fail.

    python -m bench.given_up_build [--runs 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.cluster import lighthouse, url
from tests.failfast.job import Job
from tests.failfast.test_given_up_build import give_up_a_build

#: How long g0 may take to commit again before the run counts it as stuck.
BOUND_S = 90.0


def one_run() -> list[float]:
    """Seconds from the second give-up to each group's next commit (g0's in a newer quorum)."""
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=60_000
    ) as lh:
        job = Job(Path(tempfile.mkdtemp(prefix="given-up-")), url(lh), 3, timeout_s=60.0)
        try:
            given_up, since = give_up_a_build(job)
            back = job.wait_for(
                "g0 to commit in a newer quorum",
                lambda events: next(
                    (
                        e
                        for e in Job.commits(events, 0, since=since)
                        if e["reduce"]["quorum_id"] > given_up
                    ),
                    None,
                ),
                BOUND_S,
            )
            others = [
                job.wait_for(
                    f"g{g} to commit",
                    lambda events, g=g: next(iter(Job.commits(events, g, since=since)), None),
                    BOUND_S,
                )["time"]
                for g in (1, 2)
            ]
            return [back["time"] - since, *(t - since for t in others)]
        finally:
            job.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    print("| run | g0 (left in the build) | g1 | g2 |")
    print("|---|---|---|---|")
    for run in range(1, args.runs + 1):
        g0, g1, g2 = one_run()
        print(f"| {run} | {g0:.2f} s | {g1:.2f} s | {g2:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
