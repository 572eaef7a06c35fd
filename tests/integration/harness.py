"""A small cluster for end-to-end tests: one lighthouse, replica groups as real processes.

The test process plays the part of the cluster scheduler and of torchrun's agent: it runs the
lighthouse, hosts each replica group's TCPStore (a fresh one per incarnation, as a restarted
torchrun job would get), starts one process per rank, and when any rank of a group dies it ends
the rest of that group and starts the group again, up to a restart budget. Ranks report their
final state through files in a temporary directory.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchheal.coordination import LighthouseServer


@dataclass(frozen=True)
class JobSpec:
    """What every rank of every group runs; see ``workers.py`` for how it is used."""

    steps: int = 4
    use_async_quorum: bool = True
    init_sync: bool = True
    min_replica_size: int = 2
    world_size_mode: str = "DYNAMIC"
    same_seed: bool = False
    max_retries: int | None = None
    timeout_s: float = 10.0
    quorum_timeout_s: float = 60.0
    transport: str = "http"  # "http" or "pg"
    lighthouse_addr: str = ""


@dataclass(frozen=True)
class GroupPlan:
    """One replica group and the failures injected into its first incarnation.

    Args:
        group: the group's index (its replica id is ``g{group}``).
        world_size: ranks in the group.
        kill_at_step: every rank SIGKILLs itself when it is about to run this step.
        fail_allreduce_at_step: the group's allreduce at this step fails (injected error).
        corrupt_first_heal: the first state this group receives from a peer is corrupted on the
            wire (one byte flipped by a proxy between the group and its source).
        start_delay_s: start the group this long after the others (an upscale).
    """

    group: int
    world_size: int = 1
    kill_at_step: int | None = None
    fail_allreduce_at_step: int | None = None
    corrupt_first_heal: bool = False
    start_delay_s: float = 0.0


@dataclass
class _Group:
    plan: GroupPlan
    procs: list[Any] = field(default_factory=list)
    store: Any = None
    incarnation: int = 0
    failures: int = 0
    finished: bool = False
    started: bool = False


@dataclass(frozen=True)
class JobResult:
    """Per (group, rank): the final state file's contents; per group: how often it failed."""

    states: dict[tuple[int, int], dict[str, Any]]
    failures: dict[int, int]
    wall_s: float


def run_job(
    target: Callable[..., None],
    spec: JobSpec,
    groups: list[GroupPlan],
    out_dir: Path,
    *,
    min_replicas: int = 2,
    join_timeout_ms: int = 100,
    heartbeat_timeout_ms: int = 1000,
    deadline_s: float = 120.0,
    max_restarts: int = 3,
) -> JobResult:
    """Run a job to completion and return every rank's final state.

    ``target(spec, plan, group_rank, store_port, incarnation, out_path)`` is the per-rank entry
    point; it must be importable by a spawned child. Raises ``AssertionError`` when the job does
    not finish in ``deadline_s`` or a group fails more than ``max_restarts`` times.
    """
    ctx = mp.get_context("spawn")
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    port = lighthouse.address().rsplit(":", 1)[1]
    spec = replace(spec, lighthouse_addr=f"http://127.0.0.1:{port}")
    state = {p.group: _Group(p) for p in groups}
    t0 = time.monotonic()

    def start(g: _Group) -> None:
        g.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        plan = g.plan if g.incarnation == 0 else GroupPlan(g.plan.group, g.plan.world_size)
        g.procs = []
        for rank in range(plan.world_size):
            out = out_dir / f"g{plan.group}_r{rank}.pt"
            p = ctx.Process(
                target=target,
                args=(spec, plan, rank, g.store.port, g.incarnation, str(out)),
                name=f"g{plan.group}r{rank}i{g.incarnation}",
                daemon=True,
            )
            p.start()
            g.procs.append(p)
        g.started = True

    try:
        while not all(g.finished for g in state.values()):
            elapsed = time.monotonic() - t0
            assert elapsed < deadline_s, f"job did not finish within {deadline_s}s; " + ", ".join(
                f"g{g.plan.group}: {[p.exitcode for p in g.procs]}" for g in state.values()
            )
            for g in state.values():
                if not g.started:
                    if elapsed >= g.plan.start_delay_s:
                        start(g)
                    continue
                if g.finished:
                    continue
                codes = [p.exitcode for p in g.procs]
                if all(c == 0 for c in codes):
                    g.finished = True
                elif any(c is not None and c != 0 for c in codes):
                    # One rank died: end the rest of the group, as torchrun would, and restart it.
                    for p in g.procs:
                        if p.exitcode is None:
                            os.kill(p.pid, signal.SIGKILL)
                        p.join(timeout=30)
                    g.failures += 1
                    assert g.failures <= max_restarts, (
                        f"group {g.plan.group} failed {g.failures} times: {codes}"
                    )
                    g.incarnation += 1
                    start(g)
            # Wait on the processes' sentinels rather than sleeping blindly.
            sentinels = [p.sentinel for g in state.values() for p in g.procs if p.exitcode is None]
            if sentinels:
                mp.connection.wait(sentinels, timeout=0.2)
            else:
                time.sleep(0.05)  # only while waiting for a delayed group's start time
    finally:
        for g in state.values():
            for p in g.procs:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=30)
        lighthouse.shutdown()

    states = {}
    for g in state.values():
        for rank in range(g.plan.world_size):
            states[(g.plan.group, rank)] = torch.load(
                out_dir / f"g{g.plan.group}_r{rank}.pt", weights_only=True
            )
    return JobResult(
        states=states,
        failures={g.plan.group: g.failures for g in state.values()},
        wall_s=time.monotonic() - t0,
    )
