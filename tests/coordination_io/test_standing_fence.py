"""A group whose manager server stalled long enough to be dropped does not commit its step.

The stall is real: the server's event loop, which sends the heartbeats, is held by a blocking
call while a real lighthouse, with a 1 s heartbeat timeout, goes on without it. The vote is the
in-process one of group rank 0, which (in a group of one rank) decides on the calling thread,
so it can be cast while the loop is still held, as a woken process's training thread does
before its heartbeat loop runs again.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest

from torchheal.coordination import ManagerServer
from torchheal.coordination.types import QuorumAsk

from .helpers import loopback, wait_until

T = timedelta(seconds=10)
HEARTBEAT_TIMEOUT_MS = 1000
LIMIT_S = HEARTBEAT_TIMEOUT_MS / 1000 / 2  # standing.limit_for: half the timeout


def ask(step: int, commit_failures: int = 0) -> QuorumAsk:
    return QuorumAsk(
        group_rank=0,
        step=step,
        checkpoint_metadata="meta",
        shrink_only=False,
        init_sync=True,
        commit_failures=commit_failures,
        timeout=T,
    )


def vote(server: ManagerServer, step: int) -> bool:
    return server.should_commit_in_process(0, step, True, T)


class HeldLoop:
    """Holds the server's event loop (no heartbeat goes out) until released."""

    def __init__(self, server: ManagerServer) -> None:
        self._release = threading.Event()
        held = threading.Event()

        async def hold() -> None:
            held.set()
            self._release.wait(30)  # blocking, on purpose: the loop stalls

        self.since = time.monotonic()
        self._done = server._server.submit(hold())
        assert held.wait(10), "the server's loop never ran the stall"

    def last_for(self, seconds: float) -> None:
        """Keep the loop held until ``seconds`` have passed since it was taken (the stimulus)."""
        time.sleep(max(0.0, self.since + seconds - time.monotonic()))

    def release(self) -> None:
        self._release.set()
        self._done.result(10)


@pytest.fixture
def group(make_lighthouse, make_manager, caplog):
    """A lighthouse, a group of one rank, and whether the group heard it was dropped."""
    caplog.set_level(logging.WARNING, logger="torchheal.coordination")
    lighthouse = make_lighthouse(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    server = make_manager(loopback(lighthouse))
    return lighthouse, server, lambda: "the lighthouse dropped this group" in caplog.text


def test_a_group_stalled_past_the_heartbeat_timeout_does_not_commit_the_step(group, caplog):
    lighthouse, server, dropped = group
    server.quorum_in_process(ask(0))
    assert vote(server, 0) is True  # the same group, unstalled, commits

    first = server.quorum_in_process(ask(1))
    held = HeldLoop(server)
    held.last_for(1.5 * HEARTBEAT_TIMEOUT_MS / 1000)  # the lighthouse drops the group
    # Voted before the loop runs again: the gap is still open.
    assert vote(server, 1) is False
    assert "this process has been stalled for" in caplog.text
    assert "although every rank voted yes" in caplog.text
    held.release()

    # Woken, the group hears the lighthouse say it was dropped from the step's quorum...
    wait_until(dropped, 10, "the lighthouse to tell the group itself that it was lost")
    assert f"the lighthouse dropped this group from quorum {first.quorum_id}" in caplog.text
    # ...and the retried step still does not commit in that quorum.
    assert vote(server, 1) is False

    # A new quorum request (saying, as a Manager does, that its commits failed): the lighthouse
    # takes the group back in a fresh quorum, and its step commits.
    again = server.quorum_in_process(ask(1, commit_failures=2))
    assert again.quorum_id > first.quorum_id
    assert vote(server, 1) is True
    assert lighthouse.status()["heartbeats"]["rep:uuid"] < LIMIT_S


def test_a_stall_below_the_limit_costs_no_commit(group, caplog):
    _, server, dropped = group
    for step in range(3):
        server.quorum_in_process(ask(step))
        held = HeldLoop(server)
        held.last_for(0.4 * LIMIT_S)  # a pause of the interpreter, say
        held.release()
        assert vote(server, step) is True
    assert not dropped()
    assert "although every rank voted yes" not in caplog.text


def test_a_gap_that_ended_before_the_quorum_request_is_forgiven(group):
    _, server, dropped = group
    server.quorum_in_process(ask(0))
    held = HeldLoop(server)
    held.last_for(1.5 * HEARTBEAT_TIMEOUT_MS / 1000)
    held.release()
    wait_until(dropped, 10, "the lighthouse to tell the group that it was lost")
    # Asked after the stall: the lighthouse can only issue this quorum with the group alive.
    server.quorum_in_process(ask(0))
    assert vote(server, 0) is True


def test_a_lighthouse_outage_is_not_a_stall_of_the_group(group, caplog):
    # A lighthouse that died (or fails over) told nobody anything: the step stands.
    lighthouse, server, dropped = group
    server.quorum_in_process(ask(0))
    gone = time.monotonic()
    lighthouse.shutdown()
    time.sleep(max(0.0, gone + 1.5 * HEARTBEAT_TIMEOUT_MS / 1000 - time.monotonic()))
    assert "lighthouse session with" in caplog.text  # the group saw it go
    assert vote(server, 0) is True
    assert not dropped()
