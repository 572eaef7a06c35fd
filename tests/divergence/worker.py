"""One replica group of the divergence guard's process tests, run as its own process.

    python -m tests.divergence.worker --group G --lighthouse URL --out FILE --steps N
        [--interval N] [--policy repair|stop|warn] [--flip-at S] [--join-at S --peer-out F]
        [--skip-optim-on-load] [--scheduler] [--compare-scheduler] [--ready-dir D --groups K]

A small MLP under fault-tolerant DDP at ``min_replica_size=1``, SGD with momentum, batches a
function of (group, step). After every commit it appends ``{"step", "digest"}`` to ``--out``
(JSON lines: a SHA-256 of the parameters and momentum buffers, with the guard's counters
``checks``, ``mismatches`` and ``last_verified``); at the end ``{"done": true, ...counters}``.

Faults: ``--flip-at S`` flips one bit of one parameter right after committing step S (silent
data corruption); ``--skip-optim-on-load`` makes ``load_state_dict`` drop the optimizer's state
(a heal that restores the model only); ``--scheduler`` steps an LR scheduler kept outside the
state dict (a heal does not restore it), ``--compare-scheduler`` registers it with
``Manager.register_fingerprint``. ``--join-at S`` starts training only once ``--peer-out``
shows step S committed (a group that joins a running job and heals).
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torchheal as ft


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        buf = optim.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            h.update(buf.numpy().tobytes())
    return h.hexdigest()


def last_step(path: Path) -> int:
    if not path.exists():
        return -1
    records = [json.loads(line) for line in path.read_text().split("\n")[:-1]]
    return max((r["step"] for r in records if "digest" in r), default=-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--interval", type=int, default=1)
    p.add_argument("--policy", default="repair")
    p.add_argument("--flip-at", type=int, default=-1)
    p.add_argument("--join-at", type=int, default=-1)
    p.add_argument("--peer-out", default="")
    p.add_argument("--ready-dir", default="")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--skip-optim-on-load", action="store_true")
    p.add_argument("--scheduler", action="store_true")
    p.add_argument("--compare-scheduler", action="store_true")
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1)  # the test dumps a stuck worker's stacks

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1000, gamma=0.5)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        if not args.skip_optim_on_load:
            inner.load_state_dict(sd["optim"])

    if args.join_at >= 0:
        # Before the Manager exists: a group that heartbeats without asking for a quorum
        # counts as a healthy straggler, and the lighthouse would not issue one without it.
        while last_step(Path(args.peer_out)) < args.join_at:
            time.sleep(0.05)  # waiting for the running job to reach the step (not a sync)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=20)),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timedelta(seconds=20),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"g{args.group}",
        divergence_check_interval=args.interval,
        on_divergence=args.policy,
    )
    if args.compare_scheduler:
        manager.register_fingerprint("scheduler", scheduler.state_dict)
    ddp = ft.DistributedDataParallel(manager, model)
    if args.ready_dir:
        ready = Path(args.ready_dir)
        (ready / f"g{args.group}").touch()
        while len(list(ready.iterdir())) < args.groups:
            time.sleep(0.01)  # start-up takes seconds; this only lines the groups up
    optimizer = ft.Optimizer(manager, inner)
    flipped = False
    with open(args.out, "a") as out:

        def write(record: dict) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()

        def counters() -> dict:
            stats = manager._telemetry.stats
            return {
                "checks": stats.divergence_checks,
                "mismatches": stats.divergence_mismatches,
                "last_verified": stats.last_verified_step,
            }

        try:
            while manager.current_step() < args.steps:
                before = manager.current_step()
                gen = torch.Generator().manual_seed(1000 * args.group + before)
                x = torch.randn(8, 16, generator=gen)
                y = torch.randn(8, 4, generator=gen)
                optimizer.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                optimizer.step()
                after = manager.current_step()
                if after > before:
                    if args.scheduler:
                        scheduler.step()
                    write({"step": after, "digest": digest(model, inner), **counters()})
                    if after == args.flip_at and not flipped:
                        flipped = True
                        with torch.no_grad():  # one bit of one weight, as a faulty host would
                            model[0].weight.view(torch.int32)[3, 5] ^= 1 << 12
                        write({"event": "flip", "step": after})
        finally:
            write({"done": True, **counters()})
            manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
