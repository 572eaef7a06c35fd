"""Step overhead of fault tolerance: fault-tolerant DDP vs stock torch DDP (and the reference).

Two replica groups of one rank each, Gloo on loopback, a ~5M-parameter MLP, batch 32, SGD.
Each configuration runs as separate processes; steps/s is measured on every group after a
warm-up and averaged. Goal: torchheal within 5% of plain DDP and at least the reference.

    python -m bench.step_overhead [--steps 120] [--warmup 20]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--rounds", type=int, default=2, help="repeat each configuration, interleaved"
    )
    args = parser.parse_args()
    worker_args = ["--steps", str(args.steps)]
    impls = ["plain", "torchheal"] + (["torchft"] if reference_available() else [])
    results: dict[str, list[float]] = {i: [] for i in impls}
    for _ in range(args.rounds):
        for impl in impls:
            if impl == "plain":
                store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                env = {"PLAIN_STORE_HOST": "127.0.0.1", "PLAIN_STORE_PORT": str(store.port)}
                result = run_workers("plain", 2, "http://unused:1", worker_args, env=env)
                del store
            else:
                with lighthouse(impl) as addr:
                    result = run_workers(impl, 2, addr, worker_args)
            assert not result.timed_out, f"{impl} run timed out"
            results[impl].append(steps_per_second(result, args.warmup))

    plain = statistics.median(results["plain"])
    print(
        f"\nStep overhead: 2 replica groups x 1 rank, Gloo, ~5M-param MLP, {args.steps} steps ({args.warmup} warm-up), median of {args.rounds}"
    )
    print(f"{'configuration':<26}{'steps/s':>10}{'vs plain DDP':>15}")
    names = {
        "plain": "plain torch DDP",
        "torchheal": "torchheal FT DDP",
        "torchft": "torchft (reference) FT DDP",
    }
    for impl in impls:
        rate = statistics.median(results[impl])
        print(f"{names[impl]:<26}{rate:>10.2f}{(rate / plain - 1) * 100:>+14.1f}%")


if __name__ == "__main__":
    main()
