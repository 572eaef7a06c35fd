"""The HSDP jobs of ``_job.py``, run as real processes by the shared harness (``tests/cluster.py``).

The fault-tolerant job gets a lighthouse, one TCPStore per replica-group incarnation and one
process per rank; the killed group must die by its planned SIGKILL and is started again. The
plain job is torch alone over one world. Ranks write their results into ``out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.cluster import Launch, lighthouse, new_store, run_processes, supervise, url
from tests.hsdp._job import RankSpec, run_ft, run_plain

__all__ = ["load", "run_ft_with_restart", "run_plain_job", "tensors"]


def run_ft_with_restart(
    out: Path,
    groups: int,
    ranks: int,
    steps: int,
    kill_group: int,
    kill_at: int,
    deadline_s: float,
    device: str = "cpu",
) -> None:
    """Fault-tolerant HSDP where ``kill_group`` SIGKILLs itself at ``kill_at`` and is restarted.

    Raises:
        AssertionError: a rank died other than by the planned SIGKILL, the killed group never
            died, or the job did not finish in time.
    """
    with lighthouse(min_replicas=groups, join_timeout_ms=100) as lh:

        def start_rank(group: int, rank: int, incarnation: int, store_port: int) -> Any:
            kill = kill_at if group == kill_group and incarnation == 0 else None
            spec = RankSpec(
                group=group,
                rank=rank,
                group_size=ranks,
                num_groups=groups,
                steps=steps,
                out_dir=str(out),
                store_port=store_port,
                lighthouse_addr=url(lh),
                kill_at_step=kill,
                device=device,
            )
            return run_ft, (spec, incarnation)

        restarts = supervise(
            start_rank,
            [Launch(g, ranks, planned_kills=int(g == kill_group)) for g in range(groups)],
            deadline_s=deadline_s,
        )
    assert restarts[kill_group] == 1, f"group {kill_group} was not killed: {restarts}"


def run_plain_job(out: Path, groups: int, ranks: int, steps: int, deadline_s: float) -> None:
    """Plain HSDP over one world of ``groups * ranks`` ranks (torch only, CPU)."""
    world_store = new_store()
    calls = [
        (run_plain, (RankSpec(g, r, ranks, groups, steps, str(out), world_store.port),))
        for g in range(groups)
        for r in range(ranks)
    ]
    run_processes(calls, deadline_s)


def load(path: Path) -> dict[str, Any]:
    """A rank's saved result."""
    return torch.load(path, weights_only=True)


def tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every saved shard (model and optimizer state) by a flat name."""
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for index, entries in state["optim"]["state"].items():
        for key, value in entries.items():
            flat[f"optim.{index}.{key}"] = value
    return flat
