"""Fault-tolerant DDP with torchheal: the script a user copies.

Start a lighthouse, then one torchrun job per replica group:

    torchheal lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \
        torchrun --master_port=29600 --nnodes=1 --nproc_per_node=1 -- examples/train_ddp.py

    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \
        torchrun --master_port=29601 --nnodes=1 --nproc_per_node=1 -- examples/train_ddp.py

Kill either job (Ctrl-C, kill -9) and start it again: the other keeps training, and the restarted
one heals from it live. Runs on CPU with Gloo by default and on CUDA with NCCL when a GPU is
present. The data is synthetic, so nothing is downloaded.

Data follows the data plan (docs/data.md): step ``s`` reads samples ``s*B .. (s+1)*B - 1`` of one
shuffled order (``B = GLOBAL_BATCH``, default 128), split over the replica groups in that step's
quorum; a failed step is read again by the next quorum, a healed group needs no loader state,
and the global batch stays ``B`` while a group is down (its survivors read more, in micro-batches
of at most ``MICRO_BATCH``, default 64). ``DATA=sampler`` reads the reference's way instead:
each group its own ``DistributedSampler`` shard, 128 / NUM_REPLICA_GROUPS per step (lossy).
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from datetime import timedelta

import torch
from torch import nn

from torchheal import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)
from torchheal.data import DataPlan, StepLoader

logging.basicConfig(level=logging.INFO)
# The reference's structured records (one per quorum, commit and abort, empty message, the data
# in their fields) are for log pipelines (TORCHFT_USE_OTEL exports them); keep them off the
# console, where the Manager's own line already says what happened.
for _name in ("torchft_quorums", "torchft_commits", "torchft_errors"):
    logging.getLogger(_name).propagate = False

STEPS = int(os.environ.get("STEPS", "1000"))
GLOBAL_BATCH = int(os.environ.get("GLOBAL_BATCH", "128"))
MICRO_BATCH = int(os.environ.get("MICRO_BATCH", "64"))
DATA = os.environ.get("DATA", "plan")


class SyntheticDataset(torch.utils.data.Dataset):
    """A fixed random classification problem: 10 classes, 3x32x32 inputs (CIFAR-10's shape)."""

    def __init__(self, size: int = 50_000) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(3, 32, 32, generator=g)
        return x, int(x.mean() > 0) + 2 * int(x[0].mean() > 0)


def build_model() -> nn.Module:
    """A small CNN for the synthetic problem; seeded, so every replica group starts the same."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def main() -> None:
    replica_group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    num_replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)

    model = build_model().to(device)
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner_optimizer.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner_optimizer.load_state_dict(sd["optim"])

    # NCCL between replica groups on GPUs, Gloo on CPU. REPLICA_PG=gloo forces Gloo, e.g. when
    # several replica groups share one GPU (NCCL refuses two ranks on one device).
    use_nccl = device.type == "cuda" and os.environ.get("REPLICA_PG", "nccl") == "nccl"
    pg = (
        ProcessGroupNCCL(timeout=timedelta(seconds=30))
        if use_nccl
        else ProcessGroupGloo(timeout=timedelta(seconds=5 if device.type == "cpu" else 30))
    )
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{replica_group}",
        timeout=timedelta(seconds=30),
        # Every group builds the same seeded model. (With init_sync at step 0 the groups but one
        # would heal from it and send zeros while counted: their share of step 0 lost.)
        init_sync=False,
    )
    model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner_optimizer)
    if DATA == "sampler":
        train_with_sampler(manager, model, optimizer, device, replica_group, num_replica_groups)
    else:
        train_with_plan(manager, model, optimizer, device)
    checks, mismatches = manager.divergence_checks()
    if checks:  # the divergence guard ran (on by default: every 100 steps)
        print(f"divergence checks {checks} mismatches {mismatches}", flush=True)
    manager.shutdown()


def train_with_plan(
    manager: Manager, model: nn.Module, optimizer: Optimizer, device: torch.device
) -> None:
    """The data plan: every sample once, ``GLOBAL_BATCH`` samples per step whoever is up."""
    dataset = SyntheticDataset()
    plan = DataPlan(
        dataset_size=len(dataset), batch_size=GLOBAL_BATCH, micro_batch=MICRO_BATCH, seed=0
    )
    # One rank per replica group here (torchheal's DDP averages across groups only): the
    # group's share is this rank's. With several data-parallel ranks per group (HSDP), pass
    # group_rank and group_size and each rank reads its slice of the group's share.
    # Workers: pass num_workers=N with multiprocessing_context="forkserver" (a worker forked
    # from a process that runs gRPC's threads can crash); the synthetic data needs none.
    loader = StepLoader(dataset, plan, manager)
    criterion = nn.CrossEntropyLoss(reduction="sum")  # scaled by the plan: sum / B overall
    while manager.current_step() < STEPS:
        optimizer.zero_grad()  # begins the step: quorum runs in the background
        batch = loader.next_step()  # this group's share of this step (after the quorum)
        loss_sum = 0.0
        for i, (inputs, labels) in enumerate(batch):
            inputs, labels = inputs.to(device), labels.to(device)
            # Micro-batches accumulate locally; only the last one's backward allreduces.
            with model.no_sync() if i < len(batch) - 1 else nullcontext():
                loss = criterion(model(inputs), labels)
                (loss * batch.loss_scale).backward()
            loss_sum += loss.item()
        optimizer.step()  # applied only if the whole replica group committed
        report(manager, loss_sum / max(1, len(batch.indices)))
    loader.close()


def train_with_sampler(
    manager: Manager,
    model: nn.Module,
    optimizer: Optimizer,
    device: torch.device,
    replica_group: int,
    num_replica_groups: int,
) -> None:
    """The reference's way: each group reads its own shard (a dead group's share is skipped)."""
    dataset = SyntheticDataset()
    # Each replica group reads its own shard; inside a group, torchrun's ranks split it further.
    sampler = DistributedSampler(
        dataset,
        replica_rank=replica_group,
        num_replica_groups=num_replica_groups,
        group_rank=int(os.environ.get("RANK", "0")),
        num_replicas=int(os.environ.get("WORLD_SIZE", "1")),
        shuffle=True,
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=GLOBAL_BATCH // num_replica_groups, sampler=sampler, num_workers=0
    )
    criterion = nn.CrossEntropyLoss()
    while manager.current_step() < STEPS:
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()  # gradients are averaged across replica groups
            optimizer.step()
            report(manager, loss.item())
            if manager.current_step() >= STEPS:
                break


def report(manager: Manager, loss: float) -> None:
    """Every 20 steps, a progress line."""
    if manager.current_step() % 20 == 0:
        # The line and its newline in one write: a group's ranks share one pipe, and print's
        # separate write of the newline lets another rank's line in between.
        step, n = manager.current_step(), manager.num_participants()
        print(f"step {step} loss {loss:.4f} participants {n}\n", end="", flush=True)


if __name__ == "__main__":
    main()
