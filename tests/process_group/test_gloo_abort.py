"""Aborting a Gloo group interrupts a collective in flight (issue 9).

Gloo's own abort does not: a collective blocked on a peer that stopped (SIGSTOP, a hung host)
waits out its whole timeout. Ours cuts the group's connections, so the survivor's collective fails
at once and a peer that resumes later cannot complete it into our buffers.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from multiprocessing.connection import Connection

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp

from bench.store_freeze import is_stopped
from tests import warm
from tests.process_group.helpers import new_store
from torchheal.process_group import ProcessGroupGloo

LONG = timedelta(seconds=60)  # the collective's own timeout: far beyond the test's bounds


def _stopper(store_addr: str, conn: Connection) -> None:
    pg = ProcessGroupGloo(timeout=LONG)
    pg.configure(store_addr, "stopper", 1, 2)
    t = torch.ones(4)
    pg.allreduce([t], ReduceOp.SUM).wait()
    conn.send("stopping")
    os.kill(os.getpid(), signal.SIGSTOP)
    # Resumed by the test after the survivor aborted: our half of the old collective must fail
    # too (the connection was cut), never complete.
    try:
        pg.allreduce([t], ReduceOp.SUM).wait()
        conn.send("completed")
    except Exception as e:
        conn.send(f"failed: {e}")


def test_abort_interrupts_a_collective_blocked_on_a_stopped_peer() -> None:
    _store, addr = new_store()
    ctx = warm.mp_context()
    parent, child = ctx.Pipe()
    stopper = ctx.Process(target=_stopper, args=(f"{addr}/g1", child), daemon=True)
    stopper.start()
    try:
        pg = ProcessGroupGloo(timeout=LONG)
        pg.configure(f"{addr}/g1", "survivor", 0, 2)
        assert pg._pair_sockets is not None and len(pg._pair_sockets) == 1
        t = torch.ones(4)
        pg.allreduce([t], ReduceOp.SUM).wait()
        assert t.tolist() == [2.0] * 4
        assert parent.poll(60) and parent.recv() == "stopping"
        while not is_stopped(stopper.pid):
            threading.Event().wait(0.01)

        work = pg.allreduce([torch.full((4,), 5.0)], ReduceOp.SUM)
        outcome: list[BaseException | None] = []

        def wait() -> None:
            try:
                work.wait()
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        pg.abort()
        # Released long before the collective's own 60 s timeout would have.
        waiter.join(20)
        assert not waiter.is_alive(), "abort did not interrupt the blocked collective"
        assert outcome and outcome[0] is not None
        assert "closed" in str(outcome[0]).lower()

        os.kill(stopper.pid, signal.SIGCONT)
        assert parent.poll(60)
        assert parent.recv().startswith("failed")
    finally:
        if stopper.is_alive():
            os.kill(stopper.pid, signal.SIGCONT)
            stopper.kill()
        stopper.join(10)


def test_abort_with_nothing_in_flight_then_reconfigure() -> None:
    _store, addr = new_store()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(f"{addr}/solo", "solo", 0, 1)
    assert pg._pair_sockets is None  # nobody to connect to
    pg.abort()
    # Aborted: a collective fails without being sent (until the next configure).
    with pytest.raises(AssertionError, match=r"process group not initialized \(aborted"):
        pg.allreduce([torch.ones(2)], ReduceOp.SUM)
    pg.configure(f"{addr}/solo2", "solo", 0, 1)
    assert pg.errored() is None
    t = torch.ones(2)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [1.0, 1.0]
