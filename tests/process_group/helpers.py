"""Shared helpers for the process group tests: per-rank threads, the collective matrix, and
a victim process for the resiliency tests (importable by spawned children)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
)

WAIT = timedelta(seconds=20)


def new_store() -> tuple[TCPStore, str]:
    """A master TCPStore on an ephemeral loopback port and its ``host:port``."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Runs ``fn(rank)`` for every rank on its own thread; re-raises the first failure."""
    with ThreadPoolExecutor(max_workers=world) as pool:
        futs = [pool.submit(fn, rank) for rank in range(world)]
        return [f.result(timeout=timeout) for f in futs]


def collective_matrix(pg: Any, rank: int, world: int, gloo: bool) -> None:
    """Runs every collective of the reference's support matrix and checks its result."""
    # allreduce with options, then with a bare ReduceOp, then through the future.
    t = torch.tensor([rank + 1.0, 10.0])
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    assert pg.allreduce([t], opts).wait(WAIT)
    expected = float(sum(range(1, world + 1)))
    assert t.tolist() == [expected, 10.0 * world]
    t = torch.tensor([float(rank)])
    pg.allreduce([t], ReduceOp.MAX).get_future().wait()
    assert t.item() == world - 1

    # allreduce_coalesced
    a, b = torch.ones(2), torch.full((3,), float(rank))
    pg.allreduce_coalesced([a, b], AllreduceCoalescedOptions()).wait(WAIT)
    assert a.tolist() == [float(world)] * 2
    assert b.tolist() == [float(sum(range(world)))] * 3

    # allgather
    outs = [[torch.zeros(2) for _ in range(world)]]
    pg.allgather(outs, [torch.full((2,), float(rank))], AllgatherOptions()).wait(WAIT)
    assert [o.tolist() for o in outs[0]] == [[float(r)] * 2 for r in range(world)]

    # allgather_into_tensor_coalesced
    flat = torch.zeros(world * 2)
    pg.allgather_into_tensor_coalesced(
        [flat], [torch.full((2,), float(rank))], AllgatherOptions()
    ).wait(WAIT)
    assert flat.tolist() == [float(r) for r in range(world) for _ in range(2)]

    # barrier
    assert pg.barrier(BarrierOptions()).wait(WAIT)

    # broadcast and broadcast_one
    t = torch.full((2,), float(rank))
    bopts = BroadcastOptions()
    bopts.rootRank = world - 1
    pg.broadcast([t], bopts).wait(WAIT)
    assert t.tolist() == [float(world - 1)] * 2
    t = torch.full((2,), float(rank))
    pg.broadcast_one(t, 0).wait(WAIT)
    assert t.tolist() == [0.0, 0.0]

    # send / recv between ranks 0 and 1
    if rank == 0:
        pg.send([torch.tensor([42.0, 43.0])], 1, 0).wait(WAIT)
    elif rank == 1:
        got = torch.zeros(2)
        pg.recv([got], 0, 0).wait(WAIT)
        assert got.tolist() == [42.0, 43.0]

    if not gloo:
        out = torch.zeros(world)
        pg.alltoall_base(out, torch.full((world,), float(rank)), [], [], AllToAllOptions()).wait(
            WAIT
        )
        assert out.tolist() == [float(r) for r in range(world)]


def victim_main(
    kind: str, store_addr: str, rank: int, world: int, timeout_s: float, conn: Connection
) -> None:
    """Child of the resiliency tests: joins the group, allreduces once, reports, then waits.

    The test SIGKILLs it while it waits, so it never shuts its group down cleanly.
    """
    from torchheal.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    cls = {"gloo": ProcessGroupGloo, "baby": ProcessGroupBabyGloo}[kind]
    pg = cls(timeout=timedelta(seconds=timeout_s))
    # Imports are done: tell the test so the survivors can start a short-timeout rendezvous.
    conn.send("ready")
    pg.configure(store_addr, "victim", rank, world)
    t = torch.tensor([rank + 1.0])
    pg.allreduce([t], ReduceOp.SUM).wait()
    conn.send(t.item())
    conn.recv()  # blocks until killed
    os.kill(os.getpid(), signal.SIGKILL)


def on_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException | None]]:
    """Starts ``fn`` on a daemon thread. Returns the thread and a list that receives, once
    ``fn`` ends, what it raised (None when it returned)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
