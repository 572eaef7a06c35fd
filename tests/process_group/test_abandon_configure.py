"""A configure whose quorum lost a member is abandoned at once, even when the lost member hosts
the rendezvous store and is frozen (issue 9).

A frozen host accepts connections (its kernel does) and never answers: c10d's store client
tries again until its timeout, whatever happens to each attempt, so cutting its connection
alone (``failfast.ConnectedQuorum.building``) would hold the configure for the group's whole
timeout. ``abandon_configure`` from another thread ends it now; the group is then configured
again as usual. The store host here is a real TCPStore in a child process that stops itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp

from tests.process_group.helpers import frozen_store_host, new_store, stopped
from torchheal.process_group import ProcessGroupGloo
from torchheal.process_group.wrappers import ErrorSwallowingProcessGroupWrapper

LONG = timedelta(seconds=60)  # the store's and the group's timeout: far beyond the bounds here
BOUND_S = 15.0  # a configure that waits for the timeout fails this


@pytest.mark.parametrize("wrapped", [False, True], ids=["gloo", "wrapped"])
def test_a_configure_on_a_frozen_store_host_ends_when_abandoned(wrapped: bool) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    host = ctx.Process(target=frozen_store_host, args=(child,), daemon=True)
    host.start()
    try:
        port = parent.recv()
        while not stopped(host.pid):
            parent.poll(0.01)  # a bounded pause: the host stops itself right after sending
        gloo = ProcessGroupGloo(timeout=LONG)
        # A wrapper around a torchheal group passes the abandon on.
        pg = ErrorSwallowingProcessGroupWrapper(gloo) if wrapped else gloo
        outcome: list[BaseException | None] = []

        def configure() -> None:
            try:
                pg.configure(f"127.0.0.1:{port}/q1", "survivor", 0, 2)
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=configure, daemon=True)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), f"the configure ended before it was abandoned: {outcome}"
        pg.abandon_configure()
        thread.join(BOUND_S)
        assert not thread.is_alive(), (
            f"the abandoned configure still waits for the frozen store after {BOUND_S}s"
        )
        (error,) = outcome
        assert isinstance(error, RuntimeError) and "abandoned" in str(error), error

        # Nothing of it is left behind: the group is configured again, and works.
        _store, addr = new_store()
        pg.configure(f"{addr}/q2", "survivor", 0, 1)
        t = torch.ones(3)
        pg.allreduce([t], ReduceOp.SUM).wait()
        assert t.tolist() == [1.0] * 3
    finally:
        os.kill(host.pid, signal.SIGKILL)
        host.join(10)


def test_abandoning_outside_a_configure_changes_nothing() -> None:
    pg = ProcessGroupGloo(timeout=LONG)
    pg.abandon_configure()  # no configure in progress (a late notice): the next one is whole
    _store, addr = new_store()
    pg.configure(f"{addr}/q1", "r", 0, 1)
    t = torch.ones(2)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [1.0, 1.0]
