"""Runs the HSDP jobs of ``_job.py`` as real processes: the test plays torchrun's agent.

The fault-tolerant job gets a lighthouse, one TCPStore per replica-group incarnation (a restarted
torchrun job gets a fresh one) and one process per rank; the killed group is started again once
all its ranks are dead. Ranks write their results into ``out``.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.hsdp._job import RankSpec, run_ft, run_plain


def _ft_entry(spec: RankSpec, incarnation: int) -> None:
    run_ft(spec, incarnation)


def _plain_entry(spec: RankSpec) -> None:
    run_plain(spec)


def _wait(procs: list[Any], deadline: float) -> None:
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _end(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


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
    """Fault-tolerant HSDP where ``kill_group`` is SIGKILLed at ``kill_at`` and restarted.

    Raises:
        AssertionError: if the group was not killed or any rank did not finish cleanly.
    """
    from torchheal.coordination import LighthouseServer

    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + deadline_s
    started: list[Any] = []
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=groups, join_timeout_ms=100)
    stores: list[dist.TCPStore] = []

    def start(group: int, incarnation: int, kill: int | None) -> list[Any]:
        stores.append(_store())
        procs = []
        for rank in range(ranks):
            spec = RankSpec(
                group=group,
                rank=rank,
                group_size=ranks,
                num_groups=groups,
                steps=steps,
                out_dir=str(out),
                store_port=stores[-1].port,
                lighthouse_addr=lighthouse.address(),
                kill_at_step=kill,
                device=device,
            )
            p = ctx.Process(target=_ft_entry, args=(spec, incarnation), daemon=True)
            p.start()
            procs.append(p)
            started.append(p)
        return procs

    try:
        first = {g: start(g, 0, kill_at if g == kill_group else None) for g in range(groups)}
        _wait(first[kill_group], deadline)
        codes = [p.exitcode for p in first[kill_group]]
        assert codes == [-signal.SIGKILL] * ranks, f"group {kill_group} was not killed: {codes}"
        restarted = start(kill_group, 1, None)
        rest = [p for g, procs in first.items() if g != kill_group for p in procs] + restarted
        _wait(rest, deadline)
        codes = [p.exitcode for p in rest]
        assert codes == [0] * len(rest), f"ranks did not finish cleanly: {codes}"
    finally:
        _end(started)
        lighthouse.shutdown()


def run_plain_job(out: Path, groups: int, ranks: int, steps: int, deadline_s: float) -> None:
    """Plain HSDP over one world of ``groups * ranks`` ranks (torch only, CPU)."""
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + deadline_s
    world_store = _store()
    procs = []
    try:
        for g in range(groups):
            for r in range(ranks):
                spec = RankSpec(g, r, ranks, groups, steps, str(out), world_store.port)
                p = ctx.Process(target=_plain_entry, args=(spec,), daemon=True)
                p.start()
                procs.append(p)
        _wait(procs, deadline)
        codes = [p.exitcode for p in procs]
        assert codes == [0] * len(procs), f"plain ranks did not finish cleanly: {codes}"
    finally:
        _end(procs)


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


__all__ = ["run_ft_with_restart", "run_plain_job", "tensors"]
