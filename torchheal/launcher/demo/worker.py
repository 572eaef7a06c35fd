"""One replica group of the demo job: fault-tolerant DDP on a small MLP with synthetic data.

Run by the launcher, one process per replica group; it reports progress as event lines
(``events.py``). Data follows the data plan (docs/data.md), and each step event says which
positions this group read, so the summary can check every sample was read once.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from torchheal._base.launch_env import LauncherEnv, TorchrunEnv
from torchheal.launcher.events import emit


def build_model(seed: int) -> nn.Module:
    """The demo model; every group starts from the same seed (init_sync also covers this)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
    )


class DemoData(torch.utils.data.Dataset):
    """A synthetic classification problem: sample ``i`` is drawn from a generator seeded by
    (seed, i), 32 inputs and one of 4 classes."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(32, generator=gen)
        y = int(x[:8].sum() > 0) + 2 * int(x[8:16].sum() > 0)
        return x, torch.tensor(y)


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's bytes, in a stable order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="train until this many steps commit")
    parser.add_argument(
        "--step-delay",
        type=float,
        default=0.05,
        help="extra seconds per step, standing in for real compute",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--global-batch", type=int, default=192, help="samples per step over all groups"
    )
    parser.add_argument("--dataset-size", type=int, default=100_000)
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="collective/transfer timeout (s)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # Imported here so `--help` stays fast.
    from torchheal import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchheal.data import DataPlan, StepLoader

    args = parse_args(argv)
    launcher = LauncherEnv.from_env()
    group = launcher.replica_group_id
    logging.basicConfig(
        level=launcher.log_level,
        format=f"[group {group}] %(levelname)s %(name)s: %(message)s",
    )

    # The launcher hosts each group's store, as torchrun's agent does; alone, host our own.
    torchrun = TorchrunEnv.from_env()
    store = None
    if torchrun.master_addr and torchrun.master_port:
        store_addr = str(torchrun.require("master_addr", "store_addr"))
        store_port = int(torchrun.require("master_port", "store_port"))
    else:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_addr, store_port = "127.0.0.1", store.port
    model = build_model(args.seed)
    optimizer_inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer_inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optimizer_inner.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr=store_addr,
        store_port=store_port,
        replica_id=f"demo_{group}",
        divergence_check_interval=100,  # docs/divergence.md
        # Every group builds the same seeded model; with init_sync all groups but one would
        # heal at step 0 and send zeros while counted, losing their share of the step.
        init_sync=False,
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optimizer_inner)
    plan = DataPlan(dataset_size=args.dataset_size, batch_size=args.global_batch, seed=args.seed)
    loader = StepLoader(DemoData(args.dataset_size, args.seed), plan, manager)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # scaled by the plan: sum / B overall
    emit("start", group, pid=os.getpid(), warm=launcher.warm_spare)

    last_quorum = None
    try:
        while manager.current_step() < args.steps:
            step_before = manager.current_step()
            optimizer.zero_grad()  # starts the quorum in the background
            batch = loader.next_step()  # this group's share of the step (after the quorum)
            loss_sum = 0.0
            for x, y in batch:  # one micro-batch: no cap on the plan
                loss = loss_fn(ddp(x), y)
                (loss * batch.loss_scale).backward()
                loss_sum += float(loss.detach())
            time.sleep(args.step_delay)
            optimizer.step()  # commits only if every rank of the group and the allreduce succeeded
            committed_step = manager.current_step()
            # A group that healed jumps from its old step to the job's step in one go.
            healed = committed_step > step_before + 1
            if manager._quorum_id != last_quorum:
                last_quorum = manager._quorum_id
                emit(
                    "quorum", group, quorum_id=last_quorum, participants=manager.num_participants()
                )
            share = batch.share
            emit(
                "step",
                group,
                step=committed_step,
                committed=committed_step > step_before,
                healed=healed,
                participants=manager.num_participants(),
                quorum_id=manager._quorum_id,
                loss=round(loss_sum / max(1, len(share.indices)), 5),
                # What this group read, for the summary's exactly-once check.
                data_step=share.key.step,
                rank=share.key.rank,
                k=share.key.participants,
                lo=share.lo,
                hi=share.hi,
                batch=plan.batch_size,
            )
        checks, mismatches = manager.divergence_checks()
        emit(
            "done",
            group,
            step=manager.current_step(),
            digest=weights_digest(model),
            divergence_checks=checks,
            divergence_mismatches=mismatches,
        )
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
