"""Sessions that break and reopen (issue 9): what a group missed meanwhile, and a request
made meanwhile.

A group dropped while it had no session hears it when it opens one again.

A group frozen past its heartbeat timeout often has no session left to hear that it was dropped:
the lighthouse ends a session whose peer stops answering its keep-alive pings, and the group's
own side, waking, gives up a session that has been silent (the freeze's own silence) before it
reads what was sent. Woken, it could then wait in a collective of that quorum until the
collective's timeout (``tests/manager/test_dropped.py``). Its Hello says which quorum it is still
in; if the lighthouse announced it lost from that one, the notice follows the Welcome.

A group woken from a freeze also finds its session silent (the freeze's own silence) and
reopens it just as its training loop asks for the next quorum: the request waits for the reopen
(milliseconds) instead of failing and being asked again a retry (0.1 s) later.

Raw sessions on the lighthouse's gRPC stream, and a real manager server; real lighthouse on
loopback.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from tests.coordination_io.helpers import loopback
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import ManagerServer


def _hello(replica_id: str, last_quorum: pb.Quorum | None = None) -> bytes:
    hello = spb.Hello(replica_id=replica_id, protocol=1)
    if last_quorum is not None:
        hello.last_quorum.CopyFrom(last_quorum)
    return spb.SessionRequest(hello=hello).SerializeToString()


def _request(replica_id: str) -> bytes:
    return spb.SessionRequest(
        quorum=spb.QuorumRequest(
            request_id=1,
            requester=pb.QuorumMember(replica_id=replica_id, step=1),
            timeout_ms=5000,
        )
    ).SerializeToString()


class _Session:
    """One raw session: requests go in through a queue, events come out of the stream."""

    def __init__(self, call, replica_id: str, last_quorum: pb.Quorum | None = None) -> None:  # type: ignore[no-untyped-def]
        self.box: queue.Queue = queue.Queue()
        self.stream = call(iter(self.box.get, None), timeout=60)
        self.box.put(_hello(replica_id, last_quorum))
        assert self.next().WhichOneof("kind") == "welcome"

    def next(self) -> spb.SessionEvent:
        return spb.SessionEvent.FromString(next(self.stream))

    def close(self) -> None:
        self.box.put(None)


@contextmanager
def _sessions(make_lighthouse) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    """Opens raw sessions (``_Session(call, ...)``) on a lighthouse of its own."""
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    channel = grpc.insecure_channel(loopback(lighthouse))
    try:
        yield channel.stream_stream(methods.LIGHTHOUSE_SESSION.path)
    finally:
        channel.close()


def _x_and_y_in_quorum_1(call) -> tuple[_Session, _Session, pb.Quorum]:  # type: ignore[no-untyped-def]
    x, y = _Session(call, "x:1"), _Session(call, "y:1")
    x.box.put(_request("x:1"))
    y.box.put(_request("y:1"))
    quorum = x.next().quorum.quorum
    assert quorum.quorum_id == 1 and y.next().quorum.quorum.quorum_id == 1
    return x, y, quorum


def test_a_group_lost_while_it_had_no_session_is_told_when_it_opens_one(make_lighthouse):
    with _sessions(make_lighthouse) as call:
        x, y, quorum = _x_and_y_in_quorum_1(call)

        x.stream.cancel()  # x's session ends: x counts as lost, and cannot hear it
        lost = y.next().lost
        assert (lost.replica_id, lost.quorum_id, lost.reason) == ("x:1", 1, "connection ended")

        # x is back, still in quorum 1 as far as it knows: it hears that it was lost from it.
        again = _Session(call, "x:1", last_quorum=quorum)
        told = again.next().lost
        assert (told.replica_id, told.quorum_id, told.reason) == ("x:1", 1, "connection ended")
        assert not told.gave_up and not told.superseded_by
        again.stream.cancel()  # (x was announced lost from quorum 1 already: y hears nothing)

        # Told once: the next session of x hears nothing of quorum 1 (the first event it gets
        # is the answer to its request).
        third = _Session(call, "x:1", last_quorum=quorum)
        third.box.put(_request("x:1"))
        y.box.put(_request("y:1"))
        assert third.next().WhichOneof("kind") == "quorum"
        third.close()
        y.close()


def test_a_group_is_told_only_of_a_loss_from_the_quorum_it_says_it_is_in(make_lighthouse):
    with _sessions(make_lighthouse) as call:
        x, y, first = _x_and_y_in_quorum_1(call)
        y.box.put(spb.SessionRequest(goodbye=spb.Goodbye(reason="done")).SerializeToString())
        assert x.next().lost.replica_id == "y:1"
        x.box.put(_request("x:1"))  # quorum 2: x alone (min_replicas=1)
        second = x.next().quorum.quorum
        assert (first.quorum_id, second.quorum_id) == (1, 2)
        x.stream.cancel()  # lost from quorum 2

        # Its Hello says quorum 1 (it never heard of 2): the loss is not about that quorum.
        back = _Session(call, "x:1", last_quorum=first)
        back.box.put(_request("x:1"))
        assert back.next().WhichOneof("kind") == "quorum"
        back.close()


def test_a_quorum_request_made_while_the_session_reopens_waits_for_it(
    make_lighthouse, make_manager
):
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    server: ManagerServer = make_manager(loopback(lighthouse), replica_id="x:1")
    link = server._link
    assert link is not None and link.session_mode

    async def ask_while_reopening() -> pb.Quorum:
        link._call.cancel()  # the session breaks: the link reopens it at once
        while link._call is not None:  # until the break is seen (then the reopen is under way)
            await asyncio.sleep(0)
        requester = pb.QuorumMember(replica_id="x:1", step=1)
        return await link.quorum(requester, timeout_s=10.0)

    quorum = server._server.submit(ask_while_reopening()).result(timeout=30)
    assert [m.replica_id for m in quorum.participants] == ["x:1"]
