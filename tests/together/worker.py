"""One replica group of the train-together tests (issue 8), run as its own process.

A tiny model under fault-tolerant DDP at ``min_replica_size=1``, with knobs that reproduce what
made groups take turns: steps longer than the join timeout, one late step, and a heal whose load
takes longer than the join timeout. Prints one JSON line per step on stdout.

    python -m tests.together.worker --group 0 --lighthouse http://127.0.0.1:PORT --stop-file F
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import torchheal


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--stop-file", required=True, help="stop once this file exists")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    p.add_argument("--load-sleep", type=float, default=0.0, help="extra seconds to load a heal")
    p.add_argument("--late-at-step", type=int, default=-1, help="be late once, at this step")
    p.add_argument("--late-s", type=float, default=0.0)
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.group)  # different weights: only a heal makes the groups agree
    model = nn.Linear(64, 64)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)

    def load_state_dict(sd: dict) -> None:
        time.sleep(args.load_sleep)  # a model whose state takes long to load
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchheal.Manager(
        pg=torchheal.ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"g{args.group}",
    )
    ddp = torchheal.DistributedDataParallel(manager, model)
    optimizer = torchheal.Optimizer(manager, inner)
    x = torch.randn(8, 64)
    was_late = False
    while not os.path.exists(args.stop_file):
        before = manager.current_step()
        if before == args.late_at_step and not was_late:
            was_late = True
            time.sleep(args.late_s)
        optimizer.zero_grad()
        out = ddp(x)
        time.sleep(args.step_sleep)
        out.sum().backward()
        optimizer.step()
        event = {
            "group": args.group,
            "time": time.time(),
            "before": before,
            "after": manager.current_step(),
            "participants": manager.num_participants(),
        }
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
