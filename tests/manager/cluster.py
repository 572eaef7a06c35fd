"""A real in-process cluster for Manager tests: lighthouse + replica groups on loopback.

Each replica group gets its own TCPStore (port 0), its own process group and its own Manager,
exactly as torchrun would give it; replica groups run their steps on their own threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore

from torchheal.coordination.lighthouse import LighthouseServer
from torchheal.manager import Manager
from torchheal.process_group.gloo import ProcessGroupGloo

TIMEOUT = timedelta(seconds=10)


@dataclass
class Replica:
    """One replica group of one rank: its Manager and a tiny model state."""

    name: str
    manager: Manager
    pg: Any
    store: TCPStore
    weight: torch.Tensor
    loads: list[int] = field(default_factory=list)  # thread idents of load_state_dict calls
    reads: set[int] = field(default_factory=set)  # thread idents of state_dict calls
    fail_loads: int = 0  # how many next loads raise

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.loads.append(threading.get_ident())
        if self.fail_loads > 0:
            self.fail_loads -= 1
            raise RuntimeError("load_state_dict failed")
        self.weight.copy_(state["weight"])

    def state(self) -> dict[str, torch.Tensor]:
        self.reads.add(threading.get_ident())
        return {"weight": self.weight}


@contextmanager
def lighthouse(min_replicas: int = 1, **kwargs: Any) -> Iterator[LighthouseServer]:
    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, **kwargs)
    try:
        yield server
    finally:
        server.shutdown()


@contextmanager
def replica(
    lh: LighthouseServer,
    name: str,
    weight: float = 0.0,
    pg: Any = None,
    **manager_kwargs: Any,
) -> Iterator[Replica]:
    """Starts a one-rank replica group named ``name`` against lighthouse ``lh``."""
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = pg if pg is not None else ProcessGroupGloo(timeout=TIMEOUT)
    holder: dict[str, Replica] = {}
    kwargs: dict[str, Any] = dict(
        min_replica_size=1,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
    )
    kwargs.update(manager_kwargs)
    manager = Manager(
        pg=pg,
        load_state_dict=lambda s: holder["r"].load(s),
        state_dict=lambda: holder["r"].state(),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lh.address(),
        replica_id=name,
        **kwargs,
    )
    r = Replica(name, manager, pg, store, torch.full((3,), float(weight)))
    holder["r"] = r
    try:
        yield r
    finally:
        manager.shutdown(wait=False)


def run_parallel(*fns: Callable[[], Any], timeout: float = 30.0) -> list[Any]:
    """Runs each function on its own thread (one per replica group); returns their results."""
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=timeout) for f in futures]
