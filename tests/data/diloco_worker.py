"""One replica group of the DiLoCo exactly-once test, run by ``tests.cluster.supervise``.

DiLoCo (one fragment, synchronous quorum) over ``WindowGuard``; inner steps read through
``StepLoader`` with ``inner_steps = sync_every``. The model is one weight per sample and both
optimizers are plain SGD with lr 1, so a committed sync moves the global weights by exactly
``-1/B`` for each sample of its window (the groups' pseudo-gradients, each its samples times
``k/B``, averaged over the ``k`` groups): the final weights name every sample the job consumed
and how often. Faults as in ``worker.py`` (first incarnation, only in a window read with every
group): ``kill_at`` SIGKILLs the group at that step's first inner step, ``freeze_at`` stops it
there for ``freeze_s``. At the end each group writes its step and weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from tests.data.worker import Numbers, PerSample


@dataclass(frozen=True)
class DiLoCoJob:
    lighthouse: str
    out_dir: str
    groups: int = 3
    steps: int = 8  # syncs
    sync_every: int = 3
    dataset_size: int = 2048
    batch_size: int = 12
    step_s: float = 0.05
    freeze_s: float = 2.5
    faults: int = 0


@dataclass(frozen=True)
class DiLoCoFaults:
    kill_at: int | None = None
    freeze_at: int | None = None


def run(job: DiLoCoJob, faults: DiLoCoFaults, group: int, incarnation: int, port: int) -> None:
    """One rank (the only one) of group ``group``."""
    from torchheal import Manager, ProcessGroupGloo
    from torchheal.data import DataPlan, StepLoader, WindowGuard
    from torchheal.local_sgd import DiLoCo

    torch.set_num_threads(1)
    model = PerSample(job.dataset_size)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    timeout = timedelta(seconds=10)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,
        # Same zeros everywhere; an init_sync heal at the first sync would replace the healers'
        # window by the primary's.
        init_sync=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        lighthouse_addr=job.lighthouse,
        replica_id=f"g{group}",
    )
    plan = DataPlan(job.dataset_size, job.batch_size, seed=3, inner_steps=job.sync_every)
    loader = StepLoader(Numbers(job.dataset_size), plan, manager, initial=(job.groups, group))
    guard = WindowGuard(manager, loader)
    out_dir = Path(job.out_dir)
    first = incarnation == 0

    def step_of(g: int) -> int:
        # A group that killed itself counts only once its restart has reported.
        path = out_dir / f"step-g{g}"
        if not path.exists():
            return 0
        incarnation, step = map(int, path.read_text().split())
        since = 1 if (out_dir / f"fault-kill-g{g}").exists() else 0
        return step if incarnation >= since else 0

    def running() -> bool:
        # Every group trains until all are at ``steps`` (a frozen one heals up to them first).
        done = len(list(out_dir.glob("fault-*")))
        return min(step_of(g) for g in range(job.groups)) < job.steps or done < job.faults

    frozen = False
    calls = 0
    with DiLoCo(guard, [model], inner, outer, sync_every=job.sync_every):
        # Stop only between windows: mid-window the model holds local progress.
        while calls % job.sync_every or running():
            calls += 1
            batch = loader.next_step()
            key = batch.share.key
            if first and key.inner == 0 and key.participants == job.groups:
                if faults.kill_at is not None and key.step >= faults.kill_at:
                    (out_dir / f"fault-kill-g{group}").touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                at = faults.freeze_at
                if at is not None and key.step >= at and not frozen:
                    frozen = True
                    (out_dir / f"fault-freeze-g{group}").touch()
                    wake = f"sleep {job.freeze_s}; kill -CONT {os.getpid()}"
                    subprocess.Popen(["sh", "-c", wake])
                    os.kill(os.getpid(), signal.SIGSTOP)
            inner.zero_grad()
            for idx in batch:
                (model(idx).sum() * batch.loss_scale).backward()
            time.sleep(job.step_s)
            inner.step()  # every sync_every inner steps: the sync, through the guard
            tmp = out_dir / f".step-g{group}"
            tmp.write_text(f"{incarnation} {manager.current_step()}")
            tmp.replace(out_dir / f"step-g{group}")  # never read half written
    result = {"step": manager.current_step(), "w": model.w.detach().tolist()}
    result["stale_syncs"] = guard.stale_syncs
    (out_dir / f"final-g{group}-i{incarnation}.json").write_text(json.dumps(result))
    manager.shutdown(wait=False)
