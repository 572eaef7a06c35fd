"""What strangers can make the lighthouse's direct lane hold before their ``Hello`` lets them in.

With a job token, a connection is a stranger's until its first frame (the ``Hello``) has shown
the token. The lane bounds what strangers hold (``lighthouse.tcp.LaneLimits``): a first frame
of at most ``hello_bytes``, ``waiting_bytes`` of unfinished hellos among them all, a ``Hello``
complete within ``hello_s`` and at most ``waiting`` stranger connections (the oldest makes room
for a newer one). The tests shrink the limits so that a handful of connections cross them, read
what the server's connections hold from the connections themselves, and see each refused
client's socket reach its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import grpc
import pytest

from tests.coordination_io.helpers import wait_until
from tests.raw_client import RawClient
from torchheal._wire import session_pb2 as spb
from torchheal._wire.splice import varint
from torchheal.coordination import LighthouseClient, LighthouseServer
from torchheal.coordination.lighthouse import tcp as lighthouse_tcp
from torchheal.coordination.rpc.frames import FrameReader

KIB = 1024


class Stranger(RawClient):
    """A raw connection to the direct lane that sends what it is told and reads its events."""

    def __init__(self, lighthouse: LighthouseServer, data: bytes = b"") -> None:
        self.events: list[spb.SessionEvent] = []
        self._reader = FrameReader(1 << 20)
        super().__init__(lighthouse.direct_port(), data)

    def arrived(self, data: bytes) -> None:
        self.events += [spb.SessionEvent.FromString(m) for m in self._reader.feed(data)]

    def closed_with(self) -> str | None:
        """The status name the server ended this session with, if it said one."""
        for event in self.events:
            if event.WhichOneof("kind") == "closed":
                return next(c.name for c in grpc.StatusCode if c.value[0] == event.closed.code)
        return None


def held_by_server(lighthouse: LighthouseServer) -> dict[tuple[Any, ...], int]:
    """Bytes of unfinished frames each live direct-lane connection holds, by client address.

    Read on the lighthouse's loop thread, from the connections' own frame readers: what the
    server really keeps, whatever its accounting says.
    """

    async def read() -> dict[tuple[Any, ...], int]:
        held = {}
        for connection in lighthouse._lane._live:
            peer = connection._transport.get_extra_info("peername")
            if peer is not None:
                held[tuple(peer[:2])] = connection._reader.pending
        return held

    return lighthouse._server.submit(read()).result(5)


SMALL = lighthouse_tcp.LaneLimits(
    hello_bytes=64 * KIB, hello_s=4.0, waiting=64, waiting_bytes=256 * KIB
)


@pytest.fixture
def start(
    job_env: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[lighthouse_tcp.LaneLimits], LighthouseServer]]:
    """``start(limits)``: a lighthouse with the job token whose lane has ``limits``."""
    job_env()  # the job token is set: strangers are everyone without it
    servers: list[LighthouseServer] = []

    def run(limits: lighthouse_tcp.LaneLimits) -> LighthouseServer:
        # Not raising: a lane from before the limits runs the test too, and fails it.
        monkeypatch.setattr(lighthouse_tcp, "LIMITS", limits, raising=False)
        servers.append(LighthouseServer("127.0.0.1:0", min_replicas=1, join_timeout_ms=1))
        return servers[-1]

    yield run
    for server in servers:
        server.shutdown()


def _quorum_of_one(lighthouse: LighthouseServer, replica_id: str) -> bool:
    """A group asks a quorum with the job token; returns whether it went over the lane."""
    client = LighthouseClient(f"127.0.0.1:{lighthouse.port()}", timedelta(seconds=10))
    try:
        quorum = client.quorum(replica_id, timedelta(seconds=10), step=1, world_size=1)
        assert [m.replica_id for m in quorum.participants] == [replica_id]
        return client.direct
    finally:
        client.close()


def test_partial_hellos_hold_bounded_memory_and_a_group_still_gets_its_quorum(
    start: Callable[[lighthouse_tcp.LaneLimits], LighthouseServer],
) -> None:
    lighthouse = start(SMALL)
    # As the report: hellos announced at 4 MiB, a part of each sent; and hellos under
    # the first-frame limit, all of them but the last byte; and one that sends nothing.
    big = varint(4 * 1024 * 1024) + b"\x00" * (256 * KIB)
    near = varint(60 * KIB) + b"\x00" * (60 * KIB - 1)
    strangers = [Stranger(lighthouse, big) for _ in range(12)]
    strangers += [Stranger(lighthouse, near) for _ in range(12)]
    idle = Stranger(lighthouse)
    sent = sum(s.sent for s in strangers)
    assert sent > 10 * SMALL.waiting_bytes  # what an unbounded lane would hold

    def settled() -> bool:
        """The server read everything: each stranger is held whole or was sent away."""
        held = held_by_server(lighthouse)
        return all(s.ended() or held.get(s.address) == s.sent for s in strangers)

    wait_until(settled, 20, "the lane to read every stranger's bytes")
    held = held_by_server(lighthouse)
    assert sum(held.values()) <= SMALL.waiting_bytes, (sum(held.values()), held)
    # The announced 4 MiB hellos are refused at their length, before anything is kept.
    assert all(s.ended() and s.closed_with() == "INVALID_ARGUMENT" for s in strangers[:12])

    # Meanwhile a group with the token is let in on the lane and gets its quorum.
    assert _quorum_of_one(lighthouse, "group-a")

    # No stranger outlives the hello's deadline: every connection is closed by the server.
    wait_until(
        lambda: all(s.ended() for s in [*strangers, idle]),
        SMALL.hello_s + 10,
        "the lane to close every stranger",
    )
    assert idle.closed_with() == "DEADLINE_EXCEEDED"
    for s in [*strangers, idle]:
        s.close()
    wait_until(lambda: not held_by_server(lighthouse), 10, "the lane to forget the strangers")


def test_the_oldest_strangers_make_room_and_a_group_still_gets_the_lane(
    start: Callable[[lighthouse_tcp.LaneLimits], LighthouseServer],
) -> None:
    cap = 4
    # A deadline far off, so that nothing but the cap can close a connection during the test.
    lighthouse = start(lighthouse_tcp.LaneLimits(hello_s=300.0, waiting=cap))
    old = [Stranger(lighthouse) for _ in range(cap)]
    wait_until(lambda: len(held_by_server(lighthouse)) == cap, 10, "the strangers to be accepted")
    new = [Stranger(lighthouse) for _ in range(3)]
    wait_until(lambda: all(s.ended() for s in old[:3]), 10, "the oldest strangers to be closed")
    assert not any(s.ended() for s in [old[3], *new])  # the cap is full, not over

    # A group that connects while strangers fill the lane is let in on it (the oldest stranger
    # makes room) and gets its quorum.
    assert _quorum_of_one(lighthouse, "group-b")
    wait_until(old[3].ended, 10, "the oldest stranger to make room for the group")
    for s in [*old, *new]:
        s.close()
    wait_until(lambda: not held_by_server(lighthouse), 10, "the lane to forget the strangers")
