"""Benchmark the lighthouse: quorum round latency and heartbeat throughput.

torchheal and, when it imports, the reference (torchft) are measured side by side in one run,
each implementation's own client against its own lighthouse, so the numbers are what a user of
either stack sees.

* **Quorum rounds.** N simulated replica groups (one thread and one ``LighthouseClient`` each,
  as N real groups would each have their own connection) call ``LighthouseClient.quorum`` in
  lock step. A round starts when the main thread releases all N (each waits on a lock of its
  own, see ``_Gates``) and ends when the last of them has the quorum; after the first round
  the membership is stable, so every round is the fast path the lighthouse takes on every
  training step. Reported: median and p99 round latency, and rounds per second over the timed
  rounds (the pauses between rounds included).
* **Heartbeats.** Several client threads call ``LighthouseClient.heartbeat`` back to back for a
  fixed time; reported: heartbeats per second and the median call latency.

The lighthouse runs in its own process (as it does in production), so the server and the load
generator do not share a GIL; on a 2-core machine each gets about one core. The two
implementations are measured in turn, N by N, in ``--passes`` passes (3; the order alternates),
and the tables give the median of the passes' medians with their range, so that a change of
the machine's load during a run falls on both alike.

torchheal's client talks to a torchheal lighthouse over one detached session on the
lighthouse's direct TCP lane (the reference's client makes unary gRPC calls): a heartbeat
returns once the lighthouse acknowledged it, as the reference's does. Several clients in one
process decode an identical quorum once (``client._decode_quorum``); the reference's client
never builds Python objects for the participants unless they are read, so neither pays
O(N) per client per round here.

Usage: ``python bench/quorum.py [--quick] [--sizes 2,16,64,256] [--impl torchheal] [--passes 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from importlib import import_module
from multiprocessing.connection import Connection
from typing import Any

# The reference logs every request at INFO from Rust; logging is not what is measured. Set
# before any child imports it (children inherit the environment).
os.environ.setdefault("RUST_LOG", "warn")

MODULES = {"torchheal": "torchheal.coordination", "reference": "torchft.coordination"}
CONNECT = timedelta(seconds=30)
ROUND_TIMEOUT = timedelta(seconds=60)
WARMUP_ROUNDS = 2


def available(impl: str) -> bool:
    """Whether an implementation's coordination module imports (in a fresh interpreter)."""
    import subprocess

    probe = subprocess.run(
        [sys.executable, "-c", f"import {MODULES[impl]}"], capture_output=True, check=False
    )
    return probe.returncode == 0


# ----------------------------------------------------------------------------------------------
# Lighthouse process


def serve(impl: str, conn: Connection) -> None:
    """Child process: start a lighthouse per ("start", min_replicas) command, reply its port;
    ("stop",) shuts the current one down; None ends the process."""
    mod = import_module(MODULES[impl])
    server = None
    while (command := conn.recv()) is not None:
        if server is not None:
            server.shutdown()
            server = None
        if command[0] == "start":
            server = mod.LighthouseServer("127.0.0.1:0", min_replicas=command[1])
            conn.send(int(server.address().rsplit(":", 1)[1]))
        else:
            conn.send(None)
    if server is not None:
        server.shutdown()


class LighthouseProcess:
    """A lighthouse of one implementation in a child process."""

    def __init__(self, impl: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(impl, child), daemon=True)
        self._proc.start()

    def start(self, min_replicas: int) -> str:
        """Start a fresh lighthouse; returns its loopback address."""
        self._conn.send(("start", min_replicas))
        if not self._conn.poll(120):
            raise RuntimeError("lighthouse process did not start")
        return f"http://127.0.0.1:{self._conn.recv()}"

    def close(self) -> None:
        self._conn.send(None)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


# ----------------------------------------------------------------------------------------------
# Measurements


@dataclass
class RoundStats:
    """Quorum round results for one implementation and N."""

    n: int
    rounds: int
    median_ms: float
    p99_ms: float
    rounds_per_s: float


@dataclass
class HeartbeatStats:
    """Heartbeat results for one implementation."""

    threads: int
    per_s: float
    median_us: float


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; exact for small samples, unlike interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


class _Gates:
    """Starts the replica threads' rounds: one lock per thread, released by the main thread.

    A ``threading.Barrier`` wakes its waiters through one condition, whose lock each woken
    thread takes in turn before it may leave: measured here without any request, the last of
    16 threads left it 340 us after the round began, against 214 us for a lock of its own
    each (15-16 us either way at N=2). That is the benchmark's cost, not the lighthouse's, and
    it is the same for both implementations. The main thread waits for the last thread of a
    round to finish before it starts the next, outside the timed part.
    """

    def __init__(self, n: int) -> None:
        self._gates = [threading.Lock() for _ in range(n)]
        for gate in self._gates:
            gate.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._count = threading.Lock()
        self._left = 0
        self.stopped = False

    def open(self) -> None:
        """Release every thread for one round (main thread)."""
        self._left = len(self._gates)
        for gate in self._gates:
            gate.release()

    def wait_done(self) -> None:
        """Block until every thread finished the round (main thread)."""
        self._done.acquire()

    def stop(self) -> None:
        """Release every thread for good (main thread, after the last round or an error)."""
        self.stopped = True
        for gate in self._gates:
            if gate.locked():  # not when its thread is still in a round (the main thread failed)
                gate.release()

    def wait(self, i: int) -> bool:
        """Thread ``i`` waits for its round; False once the benchmark stops."""
        self._gates[i].acquire()
        return not self.stopped

    def finished(self) -> None:
        """This thread's round is over (its answer or its error)."""
        with self._count:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done.release()


def measure_rounds(client_cls: Any, addr: str, n: int, rounds: int) -> RoundStats:
    """Run ``WARMUP_ROUNDS + rounds`` lock-step quorum rounds of ``n`` replica groups."""
    total = WARMUP_ROUNDS + rounds
    starts: list[float] = []
    ends = [[0.0] * n for _ in range(total)]
    errors: list[BaseException] = []
    gates = _Gates(n)
    clients = [client_cls(addr, CONNECT) for _ in range(n)]

    def replica(i: int) -> None:
        client = clients[i]
        rid = f"replica_{i:04d}"
        r = 0
        while gates.wait(i):
            try:
                client.quorum(rid, ROUND_TIMEOUT, step=r)
                ends[r][i] = time.perf_counter()
            except BaseException as e:  # reported by the main thread
                errors.append(e)
            finally:
                gates.finished()
            r += 1

    threads = [threading.Thread(target=replica, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        for _ in range(total):
            starts.append(time.perf_counter())  # the round starts as the threads are released
            gates.open()
            gates.wait_done()
            if errors:
                break
    finally:
        gates.stop()
    for t in threads:
        t.join()
    for c in clients:
        close = getattr(c, "close", None)  # torchheal's client; the reference's has none
        if close is not None:
            close()
    if errors:
        raise RuntimeError(f"quorum round failed: {errors[0]!r}") from errors[0]
    latencies = [max(ends[r]) - starts[r] for r in range(WARMUP_ROUNDS, total)]
    elapsed = max(ends[total - 1]) - starts[WARMUP_ROUNDS]
    return RoundStats(
        n=n,
        rounds=rounds,
        median_ms=statistics.median(latencies) * 1e3,
        p99_ms=percentile(latencies, 0.99) * 1e3,
        rounds_per_s=rounds / elapsed,
    )


def measure_heartbeats(client_cls: Any, addr: str, threads: int, seconds: float) -> HeartbeatStats:
    """Hammer ``heartbeat`` from ``threads`` clients for ``seconds``."""
    clients = [client_cls(addr, CONNECT) for _ in range(threads)]
    latencies: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def hammer(i: int) -> None:
        client, mine = clients[i], latencies[i]
        rid = f"hb_{i}"
        timeout = timedelta(seconds=5)
        client.heartbeat(rid, timeout)  # connect before timing
        start.wait()
        while not stop.is_set():
            t0 = time.perf_counter()
            client.heartbeat(rid, timeout)
            mine.append(time.perf_counter() - t0)

    workers = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    stop.wait(seconds)  # the measurement window; nothing sets it early
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    for c in clients:
        close = getattr(c, "close", None)
        if close is not None:
            close()
    flat = [x for mine in latencies for x in mine]
    return HeartbeatStats(
        threads=threads, per_s=len(flat) / elapsed, median_us=statistics.median(flat) * 1e6
    )


def rounds_for(n: int, quick: bool) -> int:
    """Timed rounds per N: fewer for large N so each size takes a few seconds."""
    base = {2: 300, 16: 150, 64: 60, 256: 20}.get(n, max(10, 3000 // max(n, 1)))
    return max(5, base // 5) if quick else base


@dataclass
class Results:
    """Every pass's measurements of one implementation."""

    rounds: dict[int, list[RoundStats]]
    heartbeats: list[HeartbeatStats]


def run(
    impls: list[str],
    sizes: list[int],
    quick: bool,
    hb_threads: int,
    hb_seconds: float,
    passes: int,
    client: str | None = None,
) -> dict[str, Results]:
    """All measurements, the implementations interleaved: in each pass every N is measured
    for each implementation in turn (the order alternating between passes), then heartbeats,
    so that a change of the machine's load during the run falls on both alike.

    Args:
        client: whose ``LighthouseClient`` drives every lighthouse; None: each its own.
    """
    lighthouses = {impl: LighthouseProcess(impl) for impl in impls}
    results = {impl: Results({n: [] for n in sizes}, []) for impl in impls}
    try:
        for p in range(passes):
            order = impls if p % 2 == 0 else impls[::-1]
            for n in sizes:
                for impl in order:
                    client_cls = import_module(MODULES[client or impl]).LighthouseClient
                    addr = lighthouses[impl].start(min_replicas=n)
                    if p == 0 and n == sizes[0]:
                        probe = client_cls(addr, CONNECT)
                        lane = getattr(probe, "direct", None)  # torchheal's client only
                        if lane is not None:
                            name = "direct session lane" if lane else "unary gRPC"
                            print(f"  {impl:9s} client talks over: {name}", file=sys.stderr)
                            probe.close()
                    stats = measure_rounds(client_cls, addr, n, rounds_for(n, quick))
                    print(
                        f"  pass {p + 1} {impl:9s} N={n:<4d} median {stats.median_ms:8.2f} ms"
                        f"  p99 {stats.p99_ms:8.2f} ms  {stats.rounds_per_s:8.1f} rounds/s"
                        f"  (load {os.getloadavg()[0]:.2f})",
                        file=sys.stderr,
                        flush=True,
                    )
                    results[impl].rounds[n].append(stats)
            for impl in order:
                client_cls = import_module(MODULES[client or impl]).LighthouseClient
                addr = lighthouses[impl].start(min_replicas=1)
                heartbeats = measure_heartbeats(client_cls, addr, hb_threads, hb_seconds)
                print(
                    f"  pass {p + 1} {impl:9s} heartbeats {heartbeats.per_s:9.0f}/s",
                    file=sys.stderr,
                    flush=True,
                )
                results[impl].heartbeats.append(heartbeats)
    finally:
        for lighthouse in lighthouses.values():
            lighthouse.close()
    return results


# ----------------------------------------------------------------------------------------------
# Report


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _median_spread(values: list[float], fmt: str) -> str:
    """The median of the passes' values, and their range when there are several."""
    mid = format(statistics.median(values), fmt)
    if len(values) < 2:
        return mid
    return f"{mid} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def report(results: dict[str, Results], sizes: list[int]) -> str:
    """The tables: for each N and implementation, the median over passes of each pass's
    median (the passes' range in brackets), p99 and rounds/s; then heartbeats; then the goals."""
    impls = list(results)
    passes = len(results[impls[0]].heartbeats)
    headers = ["N"]
    for impl in impls:
        headers += [f"{impl} median ms", f"{impl} p99 ms", f"{impl} rounds/s"]
    rows = []
    for n in sizes:
        row = [str(n)]
        for impl in impls:
            stats = results[impl].rounds[n]
            row += [
                _median_spread([s.median_ms for s in stats], ".2f"),
                f"{statistics.median(s.p99_ms for s in stats):.2f}",
                f"{statistics.median(s.rounds_per_s for s in stats):.1f}",
            ]
        rows.append(row)
    what = f"median of {passes} passes' medians (their range)" if passes > 1 else "one pass"
    out = [
        f"Quorum rounds (N replica groups, all get the quorum; {what})",
        table(headers, rows),
        "",
    ]
    hb_rows = [
        [
            impl,
            str(r.heartbeats[0].threads),
            _median_spread([hb.per_s for hb in r.heartbeats], ".0f"),
            f"{statistics.median(hb.median_us for hb in r.heartbeats):.0f}",
        ]
        for impl, r in results.items()
    ]
    out += [
        "Heartbeats",
        table(["impl", "client threads", "heartbeats/s", "median us"], hb_rows),
    ]
    if "reference" in results and "torchheal" in results:
        ours, theirs = results["torchheal"], results["reference"]
        lines = []
        worse = []
        for n in sizes:
            mine = [s.median_ms for s in ours.rounds[n]]
            ref = [s.median_ms for s in theirs.rounds[n]]
            if statistics.median(mine) > statistics.median(ref):
                worse.append(n)
            ahead = sum(m < r for m, r in zip(mine, ref, strict=True))
            ratio = statistics.median(mine) / statistics.median(ref)
            lines.append(f"N={n}: {ratio:.2f}x the reference's, ahead in {ahead}/{passes} passes")
        out += [
            "",
            "goal: torchheal median round latency <= reference at every N: "
            + ("met" if not worse else f"MISSED at N={worse}")
            + " ("
            + "; ".join(lines)
            + ")",
        ]
        hb = statistics.median(h.per_s for h in ours.heartbeats)
        ref_hb = statistics.median(h.per_s for h in theirs.heartbeats)
        out.append(
            f"goal: torchheal heartbeats/s >= reference: {'met' if hb >= ref_hb else 'MISSED'} "
            f"({hb / ref_hb:.2f}x)"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="about 5x fewer rounds, 1 s of heartbeats"
    )
    parser.add_argument("--sizes", default="2,16,64,256", help="comma-separated N values")
    parser.add_argument(
        "--impl", choices=[*MODULES, "both"], default="both", help="which implementation(s)"
    )
    parser.add_argument(
        "--client",
        choices=list(MODULES),
        default=None,
        help="drive every lighthouse with this implementation's client (default: its own), "
        "to tell server cost from client cost",
    )
    parser.add_argument("--hb-threads", type=int, default=4, help="heartbeat client threads")
    parser.add_argument("--hb-seconds", type=float, default=None, help="heartbeat window")
    parser.add_argument(
        "--passes",
        type=int,
        default=3,
        help="interleaved passes over every N and implementation (the tables give medians)",
    )
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    hb_seconds = args.hb_seconds if args.hb_seconds is not None else (1.0 if args.quick else 3.0)
    wanted = list(MODULES) if args.impl == "both" else [args.impl]
    impls: list[str] = []
    for impl in wanted:
        if available(impl):
            impls.append(impl)
        else:
            print(f"note: {impl} ({MODULES[impl]}) does not import; skipped", file=sys.stderr)
    if not impls:
        return 1
    started = time.monotonic()
    load = os.getloadavg()[0]
    results = run(
        impls, sizes, args.quick, args.hb_threads, hb_seconds, max(1, args.passes), args.client
    )
    print(report(results, sizes))
    print(
        f"\n({os.cpu_count()} CPUs, {time.monotonic() - started:.0f} s, load average "
        f"{load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
