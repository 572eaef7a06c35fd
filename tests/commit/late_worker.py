"""One replica group of the late-committer test (issue 40, bug 1), run as its own process.

    python -m tests.commit.late_worker --group G --groups K --lighthouse URL --stop-file F \
        --out FILE --ready-dir DIR [--fail-at S] [--busy-after S --busy-s T [--frozen]] \
        [--pause-after-fail T] [--level-dir D --level-count N] [--impl torchheal|torchft]
        [--interval N] [--policy repair|stop|warn]

A small MLP under fault-tolerant DDP at ``min_replica_size=1``, SGD with momentum (optimizer
state a heal must carry), on batches that are a function of (group, step): a step redone
without a group's contribution gives other weights than the commit that had it. The groups
start training together (each waits until all ``--groups`` wrote their file in ``--ready-dir``).
With ``--fail-at S`` the group reports an error of its own (``manager.report_error``, as a
training loop does) in the first step from S on whose quorum holds all the groups, so it votes
no while its peers' collectives completed. With ``--busy-after S`` the group sleeps
``--busy-s`` seconds right after committing the first such step (an eval, a checkpoint save)
before it asks for its next quorum; with ``--frozen`` the whole process stops instead
(SIGSTOP, woken by a child after ``--busy-s``: its heartbeats stop too, as in a pause that holds
the interpreter or a stalled host). With ``--pause-after-fail T`` a failing group sleeps ``T``
seconds after its first commit since its failure (so that a frozen peer comes back level with
it). With ``--level-dir D --level-count N`` the busy group, after its busy time, and a failing
group, after its first commit since its failure, wait until N groups got there: they ask for
their next quorum together, level, as when the others' redo took as long as the busy time
(under a lighthouse that lets them redo the step, nobody then heals). Both write
``{"group", "event", "step"}`` when they act.

After every commit it appends ``{"group", "step", "digest"}`` to ``--out`` (JSON lines), the
digest a SHA-256 of the parameters and the momentum buffers (with torchheal, the divergence
guard's counters ``checks`` and ``mismatches`` too; ``--interval`` and ``--policy`` set the
guard, its defaults otherwise). Each step takes ``--step-s`` (50 ms) more than its compute; the
group stops once ``--stop-file`` exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def digest(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        buf = optim.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            h.update(buf.numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--ready-dir", required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--out", required=True)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--busy-after", type=int, default=-1)
    p.add_argument("--busy-s", type=float, default=0.0)
    p.add_argument("--frozen", action="store_true")
    p.add_argument("--pause-after-fail", type=float, default=0.0)
    p.add_argument("--level-dir", default="")
    p.add_argument("--level-count", type=int, default=0)
    p.add_argument("--impl", choices=("torchheal", "torchft"), default="torchheal")
    p.add_argument("--interval", type=int, default=None, help="the guard's (torchheal only)")
    p.add_argument("--policy", default=None, help="the guard's policy (torchheal only)")
    args = p.parse_args()
    ft = __import__(args.impl)
    guard = {}
    if args.interval is not None:
        guard["divergence_check_interval"] = args.interval
    if args.policy is not None:
        guard["on_divergence"] = args.policy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"g{args.group}",
        **guard,
    )
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)
    ready = Path(args.ready_dir)
    (ready / f"g{args.group}").touch()
    while len(list(ready.iterdir())) < args.groups:
        time.sleep(0.01)  # start-up takes seconds; this only lines the groups up
    failed = busy = levelled = False

    def level() -> None:
        # A barrier of files, as the start's: the scenario's shape, not a timing.
        (Path(args.level_dir) / f"g{args.group}").touch()
        while len(list(Path(args.level_dir).iterdir())) < args.level_count:
            time.sleep(0.01)

    with open(args.out, "a") as out:

        def write(record: dict) -> None:
            out.write(json.dumps({"group": args.group, **record}) + "\n")
            out.flush()

        def counters() -> dict:
            if args.impl != "torchheal":
                return {}  # the reference has no guard
            stats = manager._telemetry.stats
            return {"checks": stats.divergence_checks, "mismatches": stats.divergence_mismatches}

        while not os.path.exists(args.stop_file):
            before = manager.current_step()
            gen = torch.Generator().manual_seed(1000 * args.group + before)
            x = torch.randn(8, 16, generator=gen)
            y = torch.randn(8, 4, generator=gen)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            time.sleep(args.step_s)  # the rest of a step's compute
            # The quorum is known once backward reduced the gradients.
            together = manager.num_participants() == args.groups
            if 0 <= args.fail_at <= before and together and not failed:
                failed = True
                write({"event": "fail", "step": before})
                manager.report_error(RuntimeError(f"injected error at step {before}"))
            optimizer.step()
            after = manager.current_step()
            if after > before:
                write({"step": after, "digest": digest(model, inner), **counters()})
                if failed and args.pause_after_fail > 0:
                    time.sleep(args.pause_after_fail)
                    args.pause_after_fail = 0.0
                if failed and args.level_dir and not levelled:
                    levelled = True
                    level()
            if 0 <= args.busy_after <= before and together and after > before and not busy:
                busy = True
                write({"event": "busy", "step": before})
                if args.frozen:
                    wake = f"sleep {args.busy_s}; kill -CONT {os.getpid()}"
                    subprocess.Popen(["sh", "-c", wake])
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    time.sleep(args.busy_s)
                if args.level_dir:
                    level()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
