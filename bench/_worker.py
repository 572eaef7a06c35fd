"""One replica group of a benchmark job, for torchheal or (side by side) the reference.

Run as ``python bench/_worker.py --impl torchheal|torchft|plain ...``. Prints event lines in the
demo's format (``@torchheal {...}``) so ``torchheal.launcher.Launcher`` can drive it. The reference
is imported only here, in the benchmarks, never by torchheal itself.

Model: an MLP of about 5M parameters (1024-2048-1024-512, plus an optional dead-weight buffer of
``--state-mb`` MB that only inflates the state to transfer when a group heals).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def emit(kind: str, group: int, **fields) -> None:
    sys.stdout.write(
        "@torchheal "
        + json.dumps({"kind": kind, "group": group, "time": time.time(), **fields})
        + "\n"
    )
    sys.stdout.flush()


def make_model(state_mb: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 512)
    )
    if state_mb:
        # A non-trainable buffer: part of the state a healing group must receive, not of the allreduce.
        model.register_buffer("ballast", torch.zeros(state_mb * 1024 * 1024 // 4))
    return model


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(group * 1_000_003 + step)
    return torch.randn(32, 1024, generator=g), torch.randn(32, 512, generator=g)


def run_ft(args: argparse.Namespace, group: int) -> None:
    ft = importlib.import_module(args.impl)  # "torchheal" or "torchft": same public API
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_model(args.state_mb)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    timeout = timedelta(seconds=args.timeout)
    pg = ft.ProcessGroupGloo(timeout=timeout)
    transport = None  # the Manager's default: HTTP
    if args.transport == "pg":
        pg_transport = importlib.import_module(f"{args.impl}.checkpointing.pg_transport")
        transport = pg_transport.PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    manager = ft.Manager(
        pg=pg,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=os.environ["TORCHHEAL_LIGHTHOUSE"],
        replica_id=f"bench_{group}",
        checkpoint_transport=transport,
    )
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)
    emit("start", group, pid=os.getpid())
    while manager.current_step() < args.steps:
        before = manager.current_step()
        optimizer.zero_grad()
        x, y = batch(group, before)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        after = manager.current_step()
        emit(
            "step",
            group,
            step=after,
            committed=after > before,
            healed=after > before + 1,
            participants=manager.num_participants(),
            quorum_id=manager._quorum_id,
        )
    emit("done", group, step=manager.current_step(), digest="-")
    manager.shutdown(wait=False)


def run_plain(args: argparse.Namespace, group: int) -> None:
    """Stock torch DDP across the groups (rank = group), for the overhead baseline."""
    store = dist.TCPStore(
        os.environ["PLAIN_STORE_HOST"], int(os.environ["PLAIN_STORE_PORT"]), is_master=False
    )
    dist.init_process_group(
        "gloo", store=store, rank=group, world_size=int(os.environ["NUM_REPLICA_GROUPS"])
    )
    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    emit("start", group, pid=os.getpid())
    for step in range(args.steps):
        optimizer.zero_grad()
        x, y = batch(group, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        emit(
            "step",
            group,
            step=step + 1,
            committed=True,
            healed=False,
            participants=dist.get_world_size(),
        )
    emit("done", group, step=args.steps, digest="-")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["torchheal", "torchft", "plain"], default="torchheal")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--state-mb", type=int, default=0)
    p.add_argument("--transport", choices=["http", "pg"], default="http")
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args()
    torch.set_num_threads(1)  # two groups share two cores
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    if args.impl == "plain":
        run_plain(args, group)
    else:
        run_ft(args, group)


if __name__ == "__main__":
    main()
