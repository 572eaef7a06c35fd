"""One replica group for the dashboard's browser test: a real Manager training a tiny model.

    python -m tests.dashboard.worker GROUP LIGHTHOUSE_ADDR

Trains forever (the test ends it, or the dashboard's kill makes its manager exit), one step
every ~50 ms, advertising loopback addresses only.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore

from torchheal import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

TIMEOUT = timedelta(seconds=5)


def main(group: int, lighthouse: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=load,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=TIMEOUT,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"dash_{group}",
        hostname="127.0.0.1",
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    gen = torch.Generator().manual_seed(group)
    while True:
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        time.sleep(0.05)
        optimizer.step()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
