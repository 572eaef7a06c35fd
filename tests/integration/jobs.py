"""The end-to-end DDP job: what each rank runs and how a whole job is run and read back.

Groups run as real processes under :func:`tests.cluster.supervise` (which restarts a group
after its planned SIGKILL and fails the test on any other death); ranks report their final
state through files in a temporary directory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tests.cluster import Launch, lighthouse, supervise, url


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
    device: str = "cpu"  # where the model and batches live ("cuda": the GPU tests)
    backend: str = "gloo"  # the replica groups' process group: "gloo" or "nccl"


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


@dataclass(frozen=True)
class JobResult:
    """Per (group, rank): the final state file's contents; per group: how often it restarted."""

    states: dict[tuple[int, int], dict[str, Any]]
    failures: dict[int, int]


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
    """Runs a job to completion and returns every rank's final state.

    ``target(spec, plan, group_rank, store_port, incarnation, out_path)`` is the per-rank entry
    point; it must be importable by a spawned child. A restarted group runs without the
    failures of its plan.
    """
    plans = {plan.group: plan for plan in groups}
    with lighthouse(
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    ) as lh:
        spec = replace(spec, lighthouse_addr=url(lh))

        def start_rank(group: int, rank: int, incarnation: int, store_port: int) -> Any:
            plan = plans[group]
            if incarnation > 0:
                plan = GroupPlan(plan.group, plan.world_size)
            out = out_dir / f"g{group}_r{rank}.pt"
            return target, (spec, plan, rank, store_port, incarnation, str(out))

        failures = supervise(
            start_rank,
            [
                Launch(
                    plan.group,
                    plan.world_size,
                    planned_kills=1 if plan.kill_at_step is not None else 0,
                    start_delay_s=plan.start_delay_s,
                )
                for plan in groups
            ],
            deadline_s=deadline_s,
            max_restarts=max_restarts,
        )
    states = {
        (plan.group, rank): torch.load(out_dir / f"g{plan.group}_r{rank}.pt", weights_only=True)
        for plan in groups
        for rank in range(plan.world_size)
    }
    return JobResult(states=states, failures=failures)
