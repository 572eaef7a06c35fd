"""Recovery time: SIGKILL one of two replica groups, restart it, and time both sides.

Reports, per implementation and state size: seconds until the survivor commits again after the
kill, and seconds from the restart to the restarted group's first commit (which includes its
process start, joining the quorum and receiving the whole state live). Same lighthouse settings
for both implementations (the reference's defaults: heartbeat timeout 5 s, join timeout 100 ms).

    python -m bench.recovery [--sizes 100,1000] [--transport http]
"""

from __future__ import annotations

import argparse

from bench._cluster import lighthouse, reference_available, run_workers
from torchheal.launcher import KillPlan
from torchheal.launcher.demo.summary import summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="extra state in MB, comma-separated")
    parser.add_argument("--transport", choices=["http", "pg"], default="http")
    parser.add_argument("--kill-at", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    args = parser.parse_args()
    impls = ["torchheal"] + (["torchft"] if reference_available() else [])
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
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


if __name__ == "__main__":
    main()
