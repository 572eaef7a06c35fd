"""One replica group of the demo job: fault-tolerant DDP on a small MLP with synthetic data.

Run by the launcher (``torchheal demo`` / ``torchheal launch``) as
``python -m torchheal.launcher.demo.worker --steps N``, one process per replica group. It reads
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHHEAL_LIGHTHOUSE`` (or ``TORCHFT_LIGHTHOUSE``)
from the environment, hosts its own TCPStore, trains until the job reaches ``--steps`` committed
steps, and reports progress as event lines (see ``events.py``).

Each group draws different batches (seeded by group and step), so the gradients really are
averaged across groups; a group that joins late heals from a peer and must end with weights
bit-identical to everyone else's.
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

from torchheal._base.config import LauncherEnv, TorchrunEnv
from torchheal.launcher.events import emit


def build_model(seed: int) -> nn.Module:
    """The demo model; every group starts from the same seed (init_sync also covers this)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
    )


def batch_for(
    group: int, step: int, seed: int, batch_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic synthetic batch for ``group`` at ``step``: inputs and class targets."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + group * 10_007 + step)
    x = torch.randn(batch_size, 32, generator=gen)
    y = (x[:, :8].sum(dim=1) > 0).long() + 2 * (x[:, 8:16].sum(dim=1) > 0).long()
    return x, y


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
        "--timeout", type=float, default=10.0, help="collective/transfer timeout (s)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # Imported here so `--help` stays fast.
    from torchheal import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    args = parse_args(argv)
    launcher = LauncherEnv.from_env()
    group = launcher.replica_group_id
    logging.basicConfig(
        level=launcher.log_level,
        format=f"[group {group}] %(levelname)s %(name)s: %(message)s",
    )

    # The launcher hosts each group's store, as torchrun's agent does; run alone, the worker
    # hosts its own.
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
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optimizer_inner)
    loss_fn = nn.CrossEntropyLoss()
    emit("start", group, pid=os.getpid(), warm=launcher.warm_spare)

    last_quorum = None
    try:
        while manager.current_step() < args.steps:
            step_before = manager.current_step()
            optimizer.zero_grad()  # starts the quorum in the background
            x, y = batch_for(group, step_before, args.seed)
            loss = loss_fn(ddp(x), y)
            loss.backward()
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
            emit(
                "step",
                group,
                step=committed_step,
                committed=committed_step > step_before,
                healed=healed,
                participants=manager.num_participants(),
                quorum_id=manager._quorum_id,
                loss=round(float(loss.detach()), 5),
            )
        emit("done", group, step=manager.current_step(), digest=weights_digest(model))
    finally:
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
