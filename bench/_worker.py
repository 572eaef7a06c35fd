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
import threading
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


def _phases(args: argparse.Namespace, *marks: float) -> dict[str, float]:
    """Milliseconds spent in each phase of one step (``--phases``), for the timeline."""
    if not args.phases:
        return {}
    now = time.perf_counter()
    names = ("start", "forward", "backward", "vote", "update")
    spans = [b - a for a, b in zip(marks, (*marks[1:], now), strict=True)]
    return {"phases": {n: round(d * 1e3, 3) for n, d in zip(names, spans, strict=True)}}


def thread_usage() -> dict[str, tuple[float, int]]:
    """CPU seconds and minor page faults so far of each thread of this process (``--phases``).

    Linux only. Python threads are named by their ``threading`` name, native ones (Gloo, gRPC,
    torch) by the kernel's name for them. Minor faults count pages the kernel had to map (and
    zero) on first touch: memory the allocator gave back to the system and took again.
    """
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    usage: dict[str, tuple[float, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return usage
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), comm)
        cpu, faults = usage.get(name, (0.0, 0))
        cpu += (int(fields[11]) + int(fields[12])) / tick
        usage[name] = (cpu, faults + int(fields[7]))
    return usage


class CpuMeter:
    """Per-thread CPU seconds and page faults between the end of the warm-up and of the run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._on = args.phases
        self._warmup = args.warmup
        self._start: dict[str, tuple[float, int]] | None = None

    def step(self, step: int) -> None:
        if self._on and self._start is None and step >= self._warmup:
            self._start = thread_usage()

    def fields(self) -> dict[str, dict[str, float]]:
        if not self._on or self._start is None:
            return {}
        end = thread_usage()
        cpu = {k: round(v[0] - self._start.get(k, (0.0, 0))[0], 3) for k, v in end.items()}
        faults = {k: v[1] - self._start.get(k, (0.0, 0))[1] for k, v in end.items()}
        return {
            "thread_cpu": {k: v for k, v in cpu.items() if v > 0},
            "thread_faults": {k: v for k, v in faults.items() if v > 0},
        }


def bucket_view(args: argparse.Namespace) -> dict[str, bool]:
    """``--bucket-view``: every DDP with gradient views into its buckets; else each its default."""
    return {"gradient_as_bucket_view": True} if args.bucket_view else {}


class UntilFull:
    """When a worker may stop: at ``--steps``, or with ``--until-full N`` once its last
    :data:`FULL_COMMITS` commits all had N participating groups, so a survivor keeps training
    until its killed peer has healed back in (else a fast survivor ends before a cold restart
    is up, and the restart trains alone from step 0: a start, not a heal). Past ``--steps``,
    :data:`UNTIL_FULL_GRACE_S` at most: a peer that never comes back does not hold the run."""

    def __init__(self, groups: int | None) -> None:
        self._groups = groups
        self._full = 0
        self._past_steps_at: float | None = None

    def committed(self, committed: bool, participants: int) -> None:
        if committed:
            self._full = self._full + 1 if participants >= (self._groups or 0) else 0

    def done(self, step: int, steps: int) -> bool:
        if step < steps:
            return False
        if self._groups is None or self._full >= FULL_COMMITS:
            return True
        now = time.monotonic()
        if self._past_steps_at is None:
            self._past_steps_at = now
        return now - self._past_steps_at > UNTIL_FULL_GRACE_S


#: ``--until-full``: commits in a row with every group that end the run past ``--steps``.
FULL_COMMITS = 5
#: ``--until-full``: how long past ``--steps`` a worker waits for every group at most.
UNTIL_FULL_GRACE_S = 120.0


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
    ddp = ft.DistributedDataParallel(manager, model, **bucket_view(args))
    optimizer = ft.Optimizer(manager, inner)
    emit("start", group, pid=os.getpid())
    cpu = CpuMeter(args)
    until = UntilFull(args.until_full)
    while not until.done(manager.current_step(), args.steps):
        before = manager.current_step()
        cpu.step(before)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        x, y = batch(group, before)
        t1 = time.perf_counter()
        loss = nn.functional.mse_loss(ddp(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if args.phases:  # the wrapper's step, split in its vote and its update
            commit = manager.should_commit()
            t4 = time.perf_counter()
            if commit:
                inner.step()
        else:
            optimizer.step()
            t4 = time.perf_counter()
        after = manager.current_step()
        until.committed(after > before, manager.num_participants())
        phases = _phases(args, t0, t1, t2, t3, t4)
        emit(
            "step",
            group,
            step=after,
            committed=after > before,
            healed=after > before + 1,
            participants=manager.num_participants(),
            quorum_id=manager._quorum_id,
            **phases,
        )
    emit("done", group, step=manager.current_step(), digest="-", **cpu.fields())
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
    ddp = nn.parallel.DistributedDataParallel(model, **bucket_view(args))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    emit("start", group, pid=os.getpid())
    cpu = CpuMeter(args)
    for step in range(args.steps):
        cpu.step(step)
        t0 = time.perf_counter()
        optimizer.zero_grad()
        x, y = batch(group, step)
        t1 = time.perf_counter()
        loss = nn.functional.mse_loss(ddp(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        t4 = t3  # no vote
        optimizer.step()
        phases = _phases(args, t0, t1, t2, t3, t4)
        emit(
            "step",
            group,
            step=step + 1,
            committed=True,
            healed=False,
            participants=dist.get_world_size(),
            **phases,
        )
    emit("done", group, step=args.steps, digest="-", **cpu.fields())
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["torchheal", "torchft", "plain"], default="torchheal")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--state-mb", type=int, default=0)
    p.add_argument("--transport", choices=["http", "pg"], default="http")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--phases", action="store_true", help="time each phase of every step")
    p.add_argument("--warmup", type=int, default=20, help="steps before CPU is counted")
    p.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    p.add_argument(
        "--until-full",
        type=int,
        default=None,
        metavar="N",
        help="past --steps, go on until the last commits all had N participants (a killed "
        "group has come back; see UntilFull)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)  # two groups share two cores
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    if args.impl == "plain":
        run_plain(args, group)
    else:
        run_ft(args, group)


if __name__ == "__main__":
    main()
