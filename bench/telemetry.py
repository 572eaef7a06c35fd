"""What the Manager's telemetry costs per step: the hooks it calls, timed alone.

Per step the Manager calls ``Telemetry.quorum`` (quorum thread), ``waited`` (only when the
training thread actually waits; counted here every step) and ``committed`` (training thread),
and wraps each allreduce's work for its error counter. This times those calls in a loop, with
the structured-record loggers off (the default), on with a handler that drops records, and with
a ``/metrics`` server being scraped by another thread, against an empty loop.

    python -m bench.telemetry            # ~10 s
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import urllib.request

from torchheal._base.telemetry_env import TelemetryEnv
from torchheal.coordination.types import QuorumResult
from torchheal.manager.telemetry import Telemetry


def per_step_ns(telemetry: Telemetry | None, steps: int) -> float:
    """Nanoseconds per step of the hooks (or of an empty loop when ``telemetry`` is None)."""
    result = QuorumResult(quorum_id=3, max_step=10, replica_world_size=2)
    start = time.perf_counter_ns()
    if telemetry is None:
        for _step in range(steps):
            pass
    else:
        for step in range(steps):
            telemetry.quorum(result, 3, 2, 0.001)
            telemetry.waited(0.0001)
            telemetry.allreduce_error_counter()
            telemetry.committed(step, 3, True)
    return (time.perf_counter_ns() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200_000)
    args = parser.parse_args()

    rows = []
    rows.append(("empty loop", per_step_ns(None, args.steps)))
    quiet = Telemetry("bench", "bench:0", 0, env=TelemetryEnv())
    rows.append(("hooks, records off (default)", per_step_ns(quiet, args.steps)))

    for name in ("torchft_quorums", "torchft_commits"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
    rows.append(("hooks, records on (NullHandler)", per_step_ns(quiet, args.steps)))
    for name in ("torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.WARNING)

    served = Telemetry(
        "bench", "bench:0", 0, env=TelemetryEnv(metrics_port=0, metrics_host="127.0.0.1")
    )
    assert served.server is not None
    stop = threading.Event()
    scrapes = [0]

    def scrape() -> None:
        url = f"http://127.0.0.1:{served.server.port}/metrics"
        while not stop.is_set():
            with urllib.request.urlopen(url, timeout=5) as answer:
                answer.read()
            scrapes[0] += 1

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    rows.append(("hooks, /metrics being scraped", per_step_ns(served, args.steps)))
    stop.set()
    thread.join(10)
    served.close()

    print(f"{'case':<36} {'ns/step':>10}")
    for name, ns in rows:
        print(f"{name:<36} {ns:>10.0f}")
    print(f"({args.steps} steps each; {scrapes[0]} scrapes during the last case)")


if __name__ == "__main__":
    main()
