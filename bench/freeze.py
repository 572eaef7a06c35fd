"""A group frozen in the middle of an allreduce: how long the survivors stay stuck (issue 9, goal 2).

Groups of one rank each (Gloo, loopback; the rejoin bench's worker: an MLP of ~5.2M parameters
with AdamW) train against a lighthouse in its own process at the reference's defaults
(``min_replicas=1``, join 100 ms, tick 100 ms, heartbeat timeout 5 s), with the Managers'
default 60 s timeout. Once all have trained together for a while, the last group stops itself
(SIGSTOP) right after it has started the first allreduce of a step: its peers are in that
collective, waiting for data it will not send, and a stopped process keeps its sockets open.
Nothing but the lighthouse can tell them it is gone (its heartbeat expires after 5 s).

Reported per implementation, the reference in the same run when it is installed:

* **survivors stuck**: from the freeze to the survivors' next commit (the longest over the
  survivors). Goal: at most the heartbeat timeout + 1 s.
* **frozen step committed**: whether the survivors committed the step they were in at the
  freeze (they should not: it lacks the frozen group's contribution, or it would have ended).
* **rejoin after SIGCONT**: the stopped group is continued once every survivor has committed
  ``--alone`` steps without it (or after ``--hold-s``); seconds to its next commit, and whether
  that commit healed it.

``--runs N`` repeats each case: a woken group's collective is not always woken by Gloo when its
peers have left (a few runs in a hundred), and only the lighthouse's notice then ends it before
the collective's timeout, so the rejoin's worst case shows over many runs, not one.

    python -m bench.freeze [--groups 2,3] [--impls torchheal,torchft] [--runs 1]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench._cluster import reference_available
from bench._rejoin import _start, lighthouse_process


@dataclass
class Freeze:
    """One frozen group's cost."""

    impl: str
    groups: int
    stuck_s: float | None
    frozen_step_committed: bool
    rejoin_s: float | None
    healed: bool


def run_freeze(impl: str, groups: int, together: int, alone: int, hold_s: float) -> Freeze:
    """Freezes the last of ``groups`` groups inside an allreduce; see the module docstring."""
    victim = groups - 1
    with tempfile.TemporaryDirectory() as tmp, lighthouse_process(impl) as addr:
        stop = os.path.join(tmp, "stop")
        freeze = os.path.join(tmp, "freeze")
        procs = [
            _start(g, impl, addr, stop, ["--freeze-file", freeze] if g == victim else [])
            for g in range(groups)
        ]
        survivors, frozen = procs[:victim], procs[victim]
        try:
            for p in procs:
                p.wait_for(
                    lambda p: (
                        sum(1 for c in p.commits() if c["participants"] == groups) >= together
                    ),
                    f"{together} commits with every group",
                )
            Path(freeze).touch()  # the victim stops inside its next allreduce
            frozen.wait_for(
                lambda p: any(e["kind"] == "stopping" for e in p.events), "the victim to stop", 60
            )
            stopped = next(e for e in frozen.events if e["kind"] == "stopping")["t"]
            deadline = time.time() + hold_s
            for p in survivors:
                p.wait_for(
                    lambda p: (
                        sum(1 for c in p.commits() if c["t"] > stopped) >= alone
                        or time.time() > deadline
                    ),
                    f"{alone} commits without the frozen group",
                    hold_s + 30,
                )
            os.killpg(frozen.popen.pid, signal.SIGCONT)
            resumed = time.time()
            frozen.wait_for(
                lambda p: any(c["t"] > resumed for c in p.commits()), "a commit after SIGCONT", 180
            )
        finally:
            Path(stop).touch()
            for p in procs:
                os.killpg(p.popen.pid, signal.SIGCONT)
                try:
                    p.popen.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait()
    stuck = []
    frozen_step_committed = False
    for p in survivors:
        after = [c for c in p.commits() if c["t"] > stopped]
        if after:
            stuck.append(after[0]["t"] - stopped)
        # The survivor's step in flight at the freeze (its first step to end after it).
        steps = [e for e in p.events if e["kind"] == "step" and e["t"] > stopped]
        frozen_step_committed |= bool(steps and steps[0]["committed"])
    first = next((c for c in frozen.commits() if c["t"] > resumed), None)
    return Freeze(
        impl=impl,
        groups=groups,
        stuck_s=max(stuck) if len(stuck) == len(survivors) else None,
        frozen_step_committed=frozen_step_committed,
        rejoin_s=(first["t"] - resumed) if first else None,
        healed=bool(first and first["healed"]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="2,3", help="group counts, comma-separated")
    parser.add_argument("--impls", default="torchheal,torchft")
    parser.add_argument("--together", type=int, default=15)
    parser.add_argument("--alone", type=int, default=5)
    parser.add_argument("--hold-s", type=float, default=90.0)
    parser.add_argument("--runs", type=int, default=1, help="runs of each case")
    args = parser.parse_args()
    impls = [i for i in args.impls.split(",") if i != "torchft" or reference_available()]
    rows = [
        run_freeze(impl, int(n), args.together, args.alone, args.hold_s)
        for n in args.groups.split(",")
        for impl in impls
        for _ in range(args.runs)
    ]
    print(
        "\nA group frozen (SIGSTOP) inside an allreduce; lighthouse at the reference's defaults "
        "(heartbeat timeout 5 s), collective timeout 60 s"
    )
    print(
        f"{'impl':<10}{'groups':>7}{'survivors stuck s':>19}{'frozen step committed':>23}"
        f"{'rejoin after SIGCONT s':>24}{'healed':>8}"
    )
    for r in rows:
        stuck = f"{r.stuck_s:.2f}" if r.stuck_s is not None else "never"
        rejoin = f"{r.rejoin_s:.2f}" if r.rejoin_s is not None else "n/a"
        print(
            f"{r.impl:<10}{r.groups:>7}{stuck:>19}{r.frozen_step_committed!s:>23}"
            f"{rejoin:>24}{('yes' if r.healed else 'no'):>8}"
        )


if __name__ == "__main__":
    main()
