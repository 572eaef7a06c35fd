"""The lighthouse's direct session lane, spoken by hand over a plain TCP socket.

The same protocol as the gRPC ``Session`` stream (``test_session.py``), in length-delimited
frames: a session that breaks it is told why (``SessionClosed``) and disconnected, a bad request
is refused and the session goes on, and a group's connection that ends is its death
certificate. The lighthouse keeps serving throughout.
"""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import timedelta

import grpc
import pytest

from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseClient, LighthouseServer
from torchheal.coordination.group.link_tcp import DirectStream
from torchheal.coordination.lighthouse.server import LighthouseObserver
from torchheal.coordination.rpc.frames import FrameReader, frame
from torchheal.coordination.session_client import heartbeat_request, issued_quorum

from .helpers import loopback, raw_call, wait_until


class Raw:
    """A hand-driven connection to a lighthouse's direct lane."""

    def __init__(self, lighthouse: LighthouseServer) -> None:
        self.sock = socket.create_connection(("127.0.0.1", lighthouse.direct_port()), timeout=10)
        self.reader = FrameReader(1 << 30)
        self.events: list[bytes] = []

    def send(self, *requests: spb.SessionRequest | bytes) -> None:
        for r in requests:
            self.sock.sendall(frame(r if isinstance(r, bytes) else r.SerializeToString()))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next(self) -> spb.SessionEvent:
        while not self.events:
            data = self.sock.recv(65536)
            assert data, "the lighthouse closed the connection"
            self.events.extend(self.reader.feed(data))
        return spb.SessionEvent.FromString(self.events.pop(0))

    def until_closed(self) -> list[spb.SessionEvent]:
        """Every event until the lighthouse closes the connection."""
        out = [spb.SessionEvent.FromString(e) for e in self.events]
        self.events = []
        while data := self.sock.recv(65536):
            out.extend(spb.SessionEvent.FromString(e) for e in self.reader.feed(data))
        return out

    def close(self) -> None:
        self.sock.close()


def _hello(replica_id: str = "x:1", detached: bool = False) -> spb.SessionRequest:
    return spb.SessionRequest(hello=spb.Hello(replica_id=replica_id, protocol=1, detached=detached))


def _request(replica_id: str, request_id: int = 1, timeout_ms: int = 5000) -> spb.SessionRequest:
    return spb.SessionRequest(
        quorum=spb.QuorumRequest(
            request_id=request_id,
            requester=pb.QuorumMember(replica_id=replica_id, step=1),
            timeout_ms=timeout_ms,
        )
    )


def _still_serving(lighthouse: LighthouseServer) -> None:
    code, _ = raw_call(
        loopback(lighthouse),
        methods.LIGHTHOUSE_HEARTBEAT.path,
        pb.LighthouseHeartbeatRequest(replica_id="probe").SerializeToString(),
    )
    assert code == grpc.StatusCode.OK
    LighthouseClient(loopback(lighthouse), timedelta(seconds=5)).heartbeat("probe")


def test_describe_announces_the_lane_and_none_when_it_is_off(make_lighthouse):
    with_lane, without = make_lighthouse(), make_lighthouse(direct_port=None)
    for server, expected in ((with_lane, with_lane.direct_port()), (without, 0)):
        code, payload = raw_call(loopback(server), methods.LIGHTHOUSE_DESCRIBE.path, b"", timeout=5)
        assert code == grpc.StatusCode.OK
        description = spb.Description.FromString(payload)
        assert (description.protocol, description.session_port) == (
            methods.SESSION_PROTOCOL,
            expected,
        )
    assert with_lane.direct_port() > 0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (frame(b"\xff\xff\xff"), "cannot parse SessionRequest"),
        (frame(spb.SessionRequest(heartbeat=spb.Heartbeat()).SerializeToString()), "hello"),
        (frame(_hello().SerializeToString()) * 2, "hello sent twice"),
        (frame(_hello("").SerializeToString()), "replica_id is empty"),
        (frame(_hello("r" * 2000).SerializeToString()), "longer than 1024 bytes"),
        (b"\xff" * 11, "malformed frame length"),
        (b"\xff\xff\xff\x7f", "over the limit"),  # a 268 MB frame announced
        (frame(_hello().SerializeToString()) + frame(b""), "empty SessionRequest"),
    ],
)
def test_a_session_that_breaks_the_protocol_is_told_why_and_disconnected(
    make_lighthouse, data, message
):
    lighthouse = make_lighthouse()
    raw = Raw(lighthouse)
    raw.send_raw(data)
    events = raw.until_closed()
    closed = [e.closed for e in events if e.WhichOneof("kind") == "closed"]
    assert len(closed) == 1 and events[-1].WhichOneof("kind") == "closed"
    assert closed[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert message in closed[0].message
    _still_serving(lighthouse)


def test_a_bad_request_is_refused_and_the_session_goes_on(make_lighthouse):
    lighthouse = make_lighthouse()
    raw = Raw(lighthouse)
    raw.send(_hello("x:1"), _request("someone-else:1", 7))
    assert raw.next().WhichOneof("kind") == "welcome"
    failed = raw.next().failed
    assert failed.request_id == 7 and "speaks for its own group only" in failed.message
    raw.send(_request("x:1", 8))
    issued = raw.next().quorum
    assert (issued.request_id, issued.quorum.quorum_id) == (8, 1)
    raw.close()


def test_detached_sessions_name_their_replicas_and_get_acks(make_lighthouse):
    lighthouse = make_lighthouse(min_replicas=2)
    raw = Raw(lighthouse)
    raw.send(_hello("tool", detached=True))
    assert raw.next().welcome.quorum_id == 0
    raw.send(
        heartbeat_request("a", 5), heartbeat_request("", 6), _request("a", 7), _request("b", 8)
    )
    assert raw.next().heartbeat_ack.ack == 5
    refused = raw.next().failed
    assert refused.request_id == 6 and "heartbeat.replica_id is empty" in refused.message
    answers = {}
    for _ in range(2):
        event = raw.next()
        answers[event.quorum.request_id] = event.quorum.quorum
    assert [m.replica_id for m in answers[7].participants] == ["a", "b"]
    assert answers[7] == answers[8]
    assert "tool" not in lighthouse.status()["heartbeats"]  # a label, not a replica
    raw.close()


def test_a_groups_connection_that_ends_is_its_death_certificate(make_lighthouse):
    # Not a detached session: the group's own. Its peers hear of its end at once, long before
    # its heartbeat could expire.
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    x, y = Raw(lighthouse), Raw(lighthouse)
    x.send(_hello("x:1"))
    y.send(_hello("y:1"))
    assert x.next().WhichOneof("kind") == y.next().WhichOneof("kind") == "welcome"
    x.send(_request("x:1", 1))
    y.send(_request("y:1", 1))
    assert x.next().quorum.quorum.quorum_id == y.next().quorum.quorum.quorum_id == 1
    x.close()
    lost = y.next().lost
    assert (lost.replica_id, lost.quorum_id, lost.reason) == ("x:1", 1, "connection ended")
    wait_until(lambda: "x:1" not in lighthouse.status()["heartbeats"], what="x forgotten")
    y.close()


def test_frames_split_across_reads_of_several_connections_arrive_whole(make_lighthouse):
    # The lane reads every connection into one shared buffer: what a read leaves unfinished
    # (half a frame) must not be overwritten by the next connection's read.
    lighthouse = make_lighthouse(min_replicas=2)
    raws = {rid: Raw(lighthouse) for rid in ("a", "b")}
    rests = {}
    for ack, (rid, raw) in enumerate(raws.items(), start=1):
        raw.send(_hello(f"tool-{rid}", detached=True))
        assert raw.next().WhichOneof("kind") == "welcome"
        request = frame(_request(rid * 40, request_id=9).SerializeToString())
        # An acknowledged heartbeat and half a request in one write: once the ack is back,
        # the lighthouse has read that half, and the other connection's read comes next.
        raw.send_raw(frame(heartbeat_request(rid * 40, ack)) + request[:30])
        assert raw.next().heartbeat_ack.ack == ack
        rests[rid] = request[30:]
    for rid, raw in raws.items():
        raw.send_raw(rests[rid])
    for raw in raws.values():
        issued = raw.next().quorum
        assert issued.request_id == 9
        assert [m.replica_id for m in issued.quorum.participants] == ["a" * 40, "b" * 40]
        raw.close()


class _SendOnJoin(LighthouseObserver):
    """An observer that, when ``replica_id`` joins, sends ``data`` on ``sock`` (from the
    lighthouse's loop: the bytes are there when the loop next looks at its sockets)."""

    def __init__(self) -> None:
        self.trigger: tuple[str, socket.socket, bytes] | None = None
        self.reasons: list[str] = []

    def joined(self, member, now):
        if self.trigger is not None and member.replica_id == self.trigger[0]:
            self.trigger[1].sendall(self.trigger[2])
            self.trigger = None

    def reason_changed(self, reason, now):
        self.reasons.append(reason)


def test_a_request_waiting_to_be_read_joins_before_the_round_is_decided(make_lighthouse):
    # The second request of a round arrives while the first is handled: it is read before
    # the first one's decision runs, so the round is decided once, not "not ready" first.
    observer = _SendOnJoin()
    lighthouse = make_lighthouse(min_replicas=2, observer=observer)
    raws = {rid: Raw(lighthouse) for rid in ("a", "b")}
    for rid, raw in raws.items():
        raw.send(_hello(rid))
        assert raw.next().WhichOneof("kind") == "welcome"
    for step in (1, 2):
        observer.reasons.clear()
        second = frame(_request("b", request_id=step).SerializeToString())
        observer.trigger = ("a", raws["b"].sock, second)
        raws["a"].send(_request("a", request_id=step))
        for raw in raws.values():
            assert raw.next().quorum.request_id == step
        if step == 2:  # the first round had no last quorum to compare with
            assert [r for r in observer.reasons if "not ready" in r] == []
            assert observer.reasons[-1].startswith("Fast quorum found!")
    for raw in raws.values():
        raw.close()


@pytest.mark.parametrize("timeout_ms", [150, 600])
def test_a_request_expires_when_its_time_is_up_and_not_before(make_lighthouse, timeout_ms):
    # 150 ms: the timer is set with the request; 600 ms (over two 100 ms ticks): the periodic
    # tick sets it later, for the same moment.
    lighthouse = make_lighthouse(min_replicas=2, quorum_tick_ms=100)
    raw = Raw(lighthouse)
    raw.send(_hello("x:1"))
    assert raw.next().WhichOneof("kind") == "welcome"
    sent = time.monotonic()
    raw.send(_request("x:1", 7, timeout_ms=timeout_ms))
    failed = raw.next().failed
    assert (failed.request_id, failed.code) == (7, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    assert time.monotonic() - sent >= timeout_ms / 1000
    wait_until(lambda: lighthouse.status()["waiting"] == [], what="the request withdrawn")
    raw.close()


def test_the_quorum_event_is_read_without_parsing_the_quorum():
    quorum = pb.Quorum(quorum_id=4, participants=[pb.QuorumMember(replica_id="m" * 300)])
    for request_id in (0, 1, 300, 2**40):
        event = spb.SessionEvent(quorum=spb.QuorumIssued(request_id=request_id, quorum=quorum))
        assert issued_quorum(event.SerializeToString()) == (
            request_id,
            quorum.SerializeToString(),
        )
    other = spb.SessionEvent(lost=spb.MemberLost(replica_id="x")).SerializeToString()
    assert issued_quorum(other) is None
    assert issued_quorum(b"\x12\x05\x08") is None  # truncated


def test_heartbeat_requests_built_from_bytes_match_the_generated_class():
    for replica_id, ack in (("a", 1), ("", 7), ("é" * 100, 2**35)):
        expected = spb.SessionRequest(heartbeat=spb.Heartbeat(replica_id=replica_id, ack=ack))
        assert heartbeat_request(replica_id, ack) == expected.SerializeToString()


def test_a_managers_direct_stream_reads_events_split_across_reads():
    # The manager's end reads into one buffer per connection: the half event a read leaves
    # must survive the next read into the same buffer.
    events = [
        spb.SessionEvent(lost=spb.MemberLost(replica_id=rid * 50, quorum_id=3, reason="gone"))
        for rid in ("x", "y")
    ]
    first, second = (frame(e.SerializeToString()) for e in events)
    with socket.create_server(("127.0.0.1", 0)) as listener:

        async def read_both() -> list[bytes]:
            stream = await DirectStream.open(
                "127.0.0.1", listener.getsockname()[1], 10, SecurityEnv()
            )
            peer, _ = await asyncio.get_running_loop().run_in_executor(None, listener.accept)
            with peer:
                peer.sendall(first + second[:20])
                got = [await stream.read()]  # the first event: that read held half the second
                peer.sendall(second[20:])
                got.append(await stream.read())
            stream.cancel()
            return got

        assert [spb.SessionEvent.FromString(e) for e in asyncio.run(read_both())] == events
