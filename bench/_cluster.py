"""Shared plumbing of the multi-process benchmarks: a lighthouse of either implementation and a
launcher run of ``bench/_worker.py``."""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from torchheal.launcher import KillPlan, Launcher, RunResult

WORKER = str(Path(__file__).with_name("_worker.py"))


def reference_available() -> bool:
    try:
        importlib.import_module("torchft.coordination")
    except Exception:
        return False
    return True


@contextmanager
def lighthouse(
    impl: str, min_replicas: int = 1, heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 100
):
    """A lighthouse of ``impl`` ("torchheal" or "torchft") on loopback; yields its address."""
    mod = importlib.import_module(
        "torchft.coordination" if impl == "torchft" else "torchheal.coordination"
    )
    server = mod.LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    try:
        yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


def run_workers(
    impl: str,
    replicas: int,
    lighthouse_addr: str,
    worker_args: list[str],
    kill_plan: KillPlan | None = None,
    env: dict[str, str] | None = None,
    deadline_s: float = 600.0,
    restart_delay_s: float = 0.0,
) -> RunResult:
    """Run ``replicas`` bench workers of ``impl`` to completion and return the events."""
    quiet = {"LOGLEVEL": "WARNING", "RUST_LOG": "warn", "OMP_NUM_THREADS": "1", **(env or {})}
    launcher = Launcher(
        [sys.executable, WORKER, "--impl", impl, *worker_args],
        replicas=replicas,
        lighthouse_addr=lighthouse_addr,
        kill_plan=kill_plan,
        restart_delay_s=restart_delay_s,
        deadline_s=deadline_s,
        env={**quiet, "TORCHFT_LIGHTHOUSE": lighthouse_addr},
        on_output=(lambda g, line: print(f"  [{impl} g{g}] {line}", file=sys.stderr))
        if os.environ.get("BENCH_VERBOSE")
        else None,
    )
    return launcher.run()
