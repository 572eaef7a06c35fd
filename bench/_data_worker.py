"""One replica group of ``bench/data_curve.py``: the DDP example's model and data, with faults.

    python -m bench._data_worker --group G --groups K --lighthouse URL --out-dir DIR \
        --data plan|sampler --steps N [--kill-at S] [--freeze-at S --freeze-s T] [--incarnation I]

Trains ``examples/train_ddp.py``'s CNN on its synthetic dataset and appends one JSON line per
attempt to ``DIR/g{G}.jsonl``: the step before and after, the quorum's participants and this
group's rank, the sum of the per-sample losses it computed and how many samples counted.
``--data plan`` reads through the data plan (constant global batch); ``--data sampler`` the
reference's way (each group its own ``DistributedSampler`` shard, a fixed per-group batch, the
loader restarting from its shard's start when the group restarts). The groups' first
incarnations start training together (a file each in ``DIR/ready``). Faults, first incarnation
only, at the first step from the given one whose quorum holds every group: ``--kill-at``
SIGKILLs the group after its quorum, before its forward pass; ``--freeze-at`` stops it there
(SIGSTOP, woken by a child after ``--freeze-s``); each writes ``DIR/fault-*`` first. A group
stops once every group's file shows a commit at ``--steps`` and ``--faults`` markers exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.dataloader import default_collate

ROOT = Path(__file__).resolve().parents[1]


def example() -> object:
    """``examples/train_ddp.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "examples" / "train_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def progress(out_dir: Path, group: int) -> int:
    """The group's step as its file shows it, counting only its latest incarnation: a group
    that killed itself (its marker is there) has made no progress until its restart has."""
    path = out_dir / f"g{group}.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # whole lines only
    since = 1 if (out_dir / f"fault-kill-g{group}").exists() else 0
    records = [json.loads(line) for line in lines]
    return max((r["after"] for r in records if r["incarnation"] >= since), default=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--data", choices=("plan", "sampler"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--global-batch", type=int, default=96)
    p.add_argument("--micro-batch", type=int, default=48)
    p.add_argument("--dataset-size", type=int, default=50_000)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--freeze-at", type=int, default=-1)
    p.add_argument("--freeze-s", type=float, default=3.0)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--faults", type=int, default=0, help="planned faults over all groups")
    p.add_argument(
        "--step-s", type=float, default=0.1, help="more seconds per step, standing in for compute"
    )
    args = p.parse_args()

    import torchheal
    from torchheal.data import DataPlan, DistributedSampler, StepLoader

    torch.set_num_threads(1)
    ex = example()
    dataset = ex.SyntheticDataset(args.dataset_size)  # type: ignore[attr-defined]
    model = ex.build_model()  # type: ignore[attr-defined]
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=10)
    manager = torchheal.Manager(
        pg=torchheal.ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        init_sync=False,  # every group builds the same seeded model
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"g{args.group}",
    )
    ddp = torchheal.DistributedDataParallel(manager, model)
    optimizer = torchheal.Optimizer(manager, inner)
    out_dir = Path(args.out_dir)
    first = args.incarnation == 0

    def fault(before: int, participants: int) -> None:
        if not first or participants != args.groups:
            return  # never when a group is already missing: the job could lose its newest step
        if 0 <= args.kill_at <= before:
            (out_dir / f"fault-kill-g{args.group}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if 0 <= args.freeze_at <= before:
            args.freeze_at = -1
            (out_dir / f"fault-freeze-g{args.group}").touch()
            subprocess.Popen(["sh", "-c", f"sleep {args.freeze_s}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)

    def record(
        out: object, before: int, k: int, rank: int | None, loss: float, indices: list[int]
    ) -> None:
        line = {"group": args.group, "before": before, "after": manager.current_step()}
        line["incarnation"] = args.incarnation
        line.update(participants=k, rank=rank, loss_sum=loss, n=len(indices), indices=indices)
        out.write(json.dumps(line) + "\n")  # type: ignore[attr-defined]
        out.flush()  # type: ignore[attr-defined]

    def running() -> bool:
        done = len(list(out_dir.glob("fault-*")))
        return min(progress(out_dir, g) for g in range(args.groups)) < args.steps or (
            done < args.faults
        )

    if first:  # line the first incarnations up: start-up takes seconds, unevenly
        ready = out_dir / "ready"
        ready.mkdir(exist_ok=True)
        (ready / f"g{args.group}").touch()
        while len(list(ready.iterdir())) < args.groups:
            time.sleep(0.01)

    with open(out_dir / f"g{args.group}.jsonl", "a") as out:
        if args.data == "plan":
            plan = DataPlan(len(dataset), args.global_batch, micro_batch=args.micro_batch, seed=0)
            loader = StepLoader(dataset, plan, manager)
            criterion = nn.CrossEntropyLoss(reduction="sum")
            while running():
                before = manager.current_step()
                optimizer.zero_grad()
                batch = loader.next_step()
                fault(before, batch.share.key.participants)
                total = 0.0
                for i, (x, y) in enumerate(batch):
                    with ddp.no_sync() if i < len(batch) - 1 else nullcontext():
                        loss = criterion(ddp(x), y)
                        (loss * batch.loss_scale).backward()
                    total += loss.item()
                time.sleep(args.step_s)
                optimizer.step()
                key, counted = batch.share.key, list(batch.indices)
                record(out, before, key.participants, key.rank, total if counted else 0.0, counted)
        else:
            sampler = DistributedSampler(
                dataset, args.group, args.groups, group_rank=0, num_replicas=1, shuffle=True
            )
            per_group = args.global_batch // args.groups
            criterion = nn.CrossEntropyLoss()
            # A DataLoader(batch_size=per_group, sampler=sampler) without workers, unrolled so
            # the batch's indices can be recorded. Each epoch of the loop starts the shard over.
            while running():
                order = list(sampler)
                for lo in range(0, len(order) - per_group + 1, per_group):
                    idx = order[lo : lo + per_group]
                    x, y = default_collate([dataset[i] for i in idx])
                    before = manager.current_step()
                    optimizer.zero_grad()
                    rank = manager.participating_rank()  # the quorum, as the plan run waits too
                    fault(before, manager.num_participants())
                    loss = criterion(ddp(x), y)
                    loss.backward()
                    time.sleep(args.step_s)
                    optimizer.step()
                    k = manager.num_participants()
                    record(out, before, k, rank, loss.item() * len(y), idx)
                    if not running():
                        break
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
