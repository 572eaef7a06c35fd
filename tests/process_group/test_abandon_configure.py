"""A configure whose quorum lost a member gives up its store connection at once, even when the
lost member hosts the rendezvous store and is frozen (issue 9).

A frozen host accepts connections (its kernel does) and never answers. c10d's store client then
waits on its first reply until the connection is cut, and tries a cut connection again until its
timeout (60 s here). ``manager.failfast`` both cuts it and calls ``abandon_configure``; these
tests do the same from a thread of their own. The store host is a real TCPStore in a child
process that stops itself.

Nobody may abandon it, either (a lighthouse that sends no notices, the reference's): the
connection then still ends within its timeout, which c10d's client alone does not do (it waits
for the host's first answer forever).

A baby group builds in its child process, out of reach of any cut: abandoning kills the child.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp

from bench.store_freeze import frozen_host
from tests.process_group.helpers import new_store, on_thread
from torchheal.process_group import ProcessGroupBabyGloo, ProcessGroupGloo
from torchheal.process_group.gloo_sockets import PairSockets
from torchheal.process_group.store import StoreConnectAbandoned, create_store_client
from torchheal.process_group.wrappers import ErrorSwallowingProcessGroupWrapper

LONG = timedelta(seconds=60)  # the store's and the group's timeout: far beyond the bounds here
BOUND_S = 15.0  # a connection that is tried again until the timeout fails this


def give_up_while_connecting(
    port: int, connect: Callable[[], object], abandon: Callable[[], None]
) -> BaseException | None:
    """Runs ``connect`` on a thread; once it waits on the frozen host, abandons it and cuts its
    connection, again and again as ``manager.failfast`` does. Returns what ``connect`` raised."""
    before = PairSockets.before()
    thread, outcome = on_thread(connect)
    thread.join(0.5)
    assert thread.is_alive(), f"the connection ended before it was given up: {outcome}"
    deadline = time.monotonic() + BOUND_S
    while thread.is_alive():
        assert time.monotonic() < deadline, f"still waiting {BOUND_S}s after it was given up"
        abandon()
        PairSockets.to_port(before, port).cut()
        thread.join(0.02)
    (error,) = outcome
    return error


def test_a_connection_to_a_frozen_store_host_ends_once_abandoned() -> None:
    abandoned = threading.Event()
    with frozen_host() as port:
        error = give_up_while_connecting(
            port,
            lambda: create_store_client(f"127.0.0.1:{port}/q", LONG, abandoned=abandoned),
            abandoned.set,
        )
    assert isinstance(error, StoreConnectAbandoned), error
    assert f"store at 127.0.0.1:{port} was abandoned" in str(error)


def test_a_connection_made_in_attempts_keeps_its_timeout() -> None:
    _store, addr = new_store()
    client = create_store_client(f"{addr}/q", LONG, abandoned=threading.Event())
    client.set("k", "v")
    assert client.get("k") == b"v"
    # Made in short attempts, it has the whole timeout for its operations (the rendezvous).
    assert client.timeout == LONG


def test_a_connection_abandoned_before_it_is_made_is_given_up() -> None:
    # The build it is for is over (its configure clears the event when it starts): whatever
    # the host would answer, no connection is handed to it.
    _store, addr = new_store()
    abandoned = threading.Event()
    abandoned.set()
    with pytest.raises(StoreConnectAbandoned, match="was abandoned"):
        create_store_client(f"{addr}/q", LONG, abandoned=abandoned)


@pytest.mark.parametrize("wrapped", [False, True], ids=["gloo", "wrapped"])
def test_a_configure_on_a_frozen_store_host_ends_when_abandoned(wrapped: bool) -> None:
    gloo = ProcessGroupGloo(timeout=LONG)
    # A wrapper around a torchheal group passes the abandon on.
    pg = ErrorSwallowingProcessGroupWrapper(gloo) if wrapped else gloo
    with frozen_host() as port:
        error = give_up_while_connecting(
            port,
            lambda: pg.configure(f"127.0.0.1:{port}/q1", "survivor", 0, 2),
            pg.abandon_configure,
        )
    assert isinstance(error, StoreConnectAbandoned), error

    # Nothing of it is left behind: the group is configured again, and works.
    _store, addr = new_store()
    pg.configure(f"{addr}/q2", "survivor", 0, 1)
    t = torch.ones(3)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [1.0] * 3


def test_a_baby_configure_waiting_for_a_peer_ends_when_abandoned() -> None:
    # The build runs in the baby's child, which the cut of this process's connections never
    # reaches: abandoning kills the child, and the configure fails at once, not at its timeout.
    store, addr = new_store()
    pg = ProcessGroupBabyGloo(timeout=LONG)
    try:
        error = give_up_while_connecting(
            store.port,
            lambda: pg.configure(f"{addr}/q1", "survivor", 0, 2),  # the peer never comes
            pg.abandon_configure,
        )
        assert isinstance(error, RuntimeError) and "abandoned" in str(error), error
        pg.abandon_configure()  # none in progress: nothing happens
        pg.configure(f"{addr}/q2", "survivor", 0, 1)  # the next configure is whole, and works
        t = torch.ones(2)
        pg.allreduce([t], ReduceOp.SUM).wait()
        assert t.tolist() == [1.0, 1.0]
    finally:
        pg.shutdown()


def test_abandoning_outside_a_configure_changes_nothing() -> None:
    pg = ProcessGroupGloo(timeout=LONG)
    pg.abandon_configure()  # no configure in progress (a late notice): the next one is whole
    _store, addr = new_store()
    pg.configure(f"{addr}/q1", "r", 0, 1)
    t = torch.ones(2)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [1.0, 1.0]


SHORT = timedelta(seconds=2)  # a timeout that must bound a connection nobody abandons
#: SHORT, plus the overrun the connection is allowed before it is cut, plus slack for a loaded
#: machine; without the cut the connection waits until the host wakes (never, here).
SHORT_BOUND_S = 10.0


def ends_within(
    bound_s: float, connect: Callable[[], object]
) -> tuple[BaseException | None, float]:
    """Runs ``connect`` on a thread; returns what it raised and how long it took, failing if it
    has not ended after ``bound_s``."""
    began = time.monotonic()
    thread, outcome = on_thread(connect)
    thread.join(bound_s)
    assert not thread.is_alive(), f"still connecting to the frozen store host after {bound_s}s"
    (error,) = outcome
    return error, time.monotonic() - began


@pytest.mark.parametrize("abandonable", [False, True], ids=["one-attempt", "attempts"])
def test_a_connection_to_a_frozen_store_host_nobody_abandons_ends_with_its_timeout(
    abandonable: bool,
) -> None:
    abandoned = threading.Event() if abandonable else None  # never set
    with frozen_host() as port:
        error, took = ends_within(
            SHORT_BOUND_S,
            lambda: create_store_client(f"127.0.0.1:{port}/q", SHORT, abandoned=abandoned),
        )
    assert error is not None and not isinstance(error, StoreConnectAbandoned), error
    assert took >= SHORT.total_seconds() * 0.9, f"gave up after {took:.2f}s, before its timeout"
    assert f"store at 127.0.0.1:{port} accepted the connection and did not answer" in str(error)
    assert "frame #" not in str(error), "c10d's C++ stack came along"


def test_a_configure_on_a_frozen_store_host_nobody_abandons_fails_with_its_timeout() -> None:
    pg = ProcessGroupGloo(timeout=SHORT)
    with frozen_host() as port:
        error, _took = ends_within(
            SHORT_BOUND_S, lambda: pg.configure(f"127.0.0.1:{port}/q1", "survivor", 0, 2)
        )
    assert error is not None and not isinstance(error, StoreConnectAbandoned), error
    # The group is configured again, and works.
    _store, addr = new_store()
    pg.configure(f"{addr}/q2", "survivor", 0, 1)
    t = torch.ones(2)
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [1.0, 1.0]
