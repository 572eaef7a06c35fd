"""One replica group of the exactly-once data test, run by ``tests.cluster.supervise``.

The model is one weight per sample (``w[i]``), a sample's loss is its weight, so the gradient
the job applies in a step shows exactly which samples it averaged and with what weight: after
the Manager's cross-group average, ``grad[i] * B`` is 1 for each of the step's samples and 0
elsewhere. Data comes from ``StepLoader`` (the plan), micro-batches accumulate under DDP's
``no_sync``. After every attempt the group appends a JSON line: the step before and after,
the quorum it read with, the samples that counted and the reduced gradient's non-zeros.

Faults are the group's own, in its first incarnation, at the first step from ``kill_at`` /
``freeze_at`` on whose quorum holds every group (so a fault never hits a job already short of a
group, where the only holder of the newest state could die and the job go back a step):
``kill_at`` SIGKILLs it after it read its share and before its forward (its peers' allreduce
then fails and they redo the step without it); ``freeze_at`` stops the whole process (SIGSTOP,
woken by a child after ``freeze_s``: its heartbeats stop too). Before either it writes a marker
file. A group stops once every group's file shows a commit at ``steps`` or beyond (a killed
group's restart, once its first incarnation's marker is there) and every planned fault's marker
is there: so a restarted group always heals back from peers still running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class Job:
    """What every group runs."""

    lighthouse: str
    out_dir: str
    groups: int = 3
    steps: int = 24
    dataset_size: int = 4096
    batch_size: int = 16
    constant: bool = True
    micro_batch: int = 4
    step_s: float = 0.1
    freeze_s: float = 2.5
    faults: int = 0  # planned faults, over all groups


@dataclass(frozen=True)
class Faults:
    kill_at: int | None = None
    freeze_at: int | None = None


class Numbers(torch.utils.data.Dataset):
    """Item ``i`` is the tensor ``[i]``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


class PerSample(nn.Module):
    """One weight per sample: the loss of sample ``i`` is ``w[i]``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.w[idx.flatten()]


def progress(out_dir: Path, group: int) -> int:
    """The group's step as its file shows it, counting only its latest incarnation: a group
    that killed itself (its marker is there) has made no progress until its restart has."""
    path = out_dir / f"g{group}.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines only
    since = 1 if (out_dir / f"fault-kill-g{group}").exists() else 0
    records = [json.loads(line) for line in lines]
    return max((r["after"] for r in records if r["incarnation"] >= since), default=0)


def run(job: Job, faults: Faults, group: int, incarnation: int, store_port: int) -> None:
    """One rank (the only one) of group ``group``."""
    from torchheal import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchheal.data import DataPlan, StepLoader

    torch.set_num_threads(1)
    model = PerSample(job.dataset_size)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    timeout = timedelta(seconds=10)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=1,
        # Every group starts from zeros; with init_sync at step 0 all but the primary would heal
        # and send zeros while counting as participants (see StepLoader).
        init_sync=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=job.lighthouse,
        replica_id=f"g{group}",
    )
    plan = DataPlan(
        dataset_size=job.dataset_size,
        batch_size=job.batch_size,
        constant_global_batch=job.constant,
        seed=11,
        micro_batch=job.micro_batch,
    )
    loader = StepLoader(Numbers(job.dataset_size), plan, manager)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    out_dir = Path(job.out_dir)
    first = incarnation == 0
    frozen = False

    def running() -> bool:
        done = len(list(out_dir.glob("fault-*")))
        return min(progress(out_dir, g) for g in range(job.groups)) < job.steps or done < job.faults

    with open(out_dir / f"g{group}.jsonl", "a") as out:
        while running():
            before = manager.current_step()
            optimizer.zero_grad()  # starts the quorum
            asked = time.perf_counter()
            batch = loader.next_step()  # waits for it: this group's share of this step
            waited = time.perf_counter() - asked
            together = batch.share.key.participants == job.groups
            if first and together and faults.kill_at is not None and before >= faults.kill_at:
                (out_dir / f"fault-kill-g{group}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
            at = faults.freeze_at
            if first and together and at is not None and before >= at and not frozen:
                frozen = True
                (out_dir / f"fault-freeze-g{group}").touch()
                subprocess.Popen(["sh", "-c", f"sleep {job.freeze_s}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
            for j, idx in enumerate(batch):
                last = j == len(batch) - 1
                with nullcontext() if last else ddp.no_sync():  # one allreduce per step
                    (ddp(idx).sum() * batch.loss_scale).backward()
            grad = model.w.grad.detach().clone()
            time.sleep(job.step_s)  # the rest of a step's compute
            optimizer.step()  # applied only if the group committed
            nz = grad.nonzero().flatten().tolist()
            record = {
                "group": group,
                "incarnation": incarnation,
                "before": before,
                "after": manager.current_step(),
                "participants": batch.share.key.participants,
                "rank": batch.share.key.rank,
                "batches_committed": batch.share.key.batches_committed,
                "indices": list(batch.indices),
                "grad": {str(i): float(grad[i]) * job.batch_size for i in nz},
                "wait_ms": round(waited * 1000, 3),  # the quorum and the share (not asserted)
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
    manager.shutdown(wait=False)
