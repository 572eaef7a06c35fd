"""The job token on the lighthouse's and the manager server's gRPC services and direct lane.

Real servers on loopback, reading the token from the environment as in a job. Each endpoint
refuses a call without the token, and one with a wrong token, with ``UNAUTHENTICATED`` and
changes nothing (a refused heartbeat or quorum request leaves the lighthouse unaware of the
replica; a refused vote is not counted; a refused kill kills nobody); the right token is
accepted.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc
import pytest

from tests.coordination_io.helpers import Background, wait_until
from tests.security.conftest import TOKEN
from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseClient, LighthouseServer, ManagerServer
from torchheal.coordination.clients.direct_session import DirectSession, SessionBroken
from torchheal.coordination.group import server as manager_server_module
from torchheal.coordination.rpc.frames import FrameReader, frame
from torchheal.coordination.types import QuorumAsk

NO_TOKEN: list[tuple[str, str]] = []
WRONG = [("authorization", "Bearer not-the-token")]
RIGHT = [("authorization", f"Bearer {TOKEN}")]
REFUSED = [pytest.param(NO_TOKEN, id="no-token"), pytest.param(WRONG, id="wrong-token")]


def call(addr: str, method: Any, request: Any, metadata: list, timeout: float = 5.0) -> Any:
    """One unary call with exactly ``metadata``; returns the response or the status code."""
    with grpc.insecure_channel(addr) as channel:
        stub = channel.unary_unary(
            method.path,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=method.response.FromString,
        )
        try:
            return stub(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            return e.code()


def stream_code(addr: str, method: Any, requests: list, metadata: list) -> grpc.StatusCode:
    """The status a streaming call ends with (after its first event, if any)."""
    with grpc.insecure_channel(addr) as channel:
        if method.path.endswith("/Session"):
            stub = channel.stream_stream(
                method.path, request_serializer=lambda m: m.SerializeToString()
            )
            responses = stub(iter(requests), timeout=5, metadata=metadata)
        else:
            stub = channel.unary_stream(
                method.path, request_serializer=lambda m: m.SerializeToString()
            )
            responses = stub(requests[0], timeout=5, metadata=metadata)
        try:
            next(responses)
        except grpc.RpcError as e:
            return e.code()
        responses.cancel()
        return grpc.StatusCode.OK


def member(replica_id: str) -> pb.QuorumMember:
    return pb.QuorumMember(replica_id=replica_id, address="a", store_address="s:1", world_size=1)


@pytest.fixture
def lighthouse(job_env: Any) -> Iterator[LighthouseServer]:
    job_env()
    # Two replicas needed: an accepted quorum request waits, where the test can see it.
    server = LighthouseServer("127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000)
    yield server
    server.shutdown()


@pytest.mark.parametrize("metadata", REFUSED)
def test_lighthouse_refuses_every_service_without_the_job_token(
    lighthouse: LighthouseServer, metadata: list
) -> None:
    addr = f"127.0.0.1:{lighthouse.port()}"
    heartbeat = pb.LighthouseHeartbeatRequest(replica_id="intruder")
    quorum = pb.LighthouseQuorumRequest(requester=member("intruder"))
    hello = spb.SessionRequest(hello=spb.Hello(replica_id="intruder", protocol=1))
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert call(addr, methods.LIGHTHOUSE_HEARTBEAT, heartbeat, metadata) == unauthenticated
    assert call(addr, methods.LIGHTHOUSE_QUORUM, quorum, metadata) == unauthenticated
    assert call(addr, methods.LIGHTHOUSE_DESCRIBE, spb.DescribeRequest(), metadata) == (
        unauthenticated
    )
    assert stream_code(addr, methods.LIGHTHOUSE_SESSION, [hello], metadata) == unauthenticated
    status = lighthouse.status()
    assert status["heartbeats"] == {} and status["waiting"] == []
    assert len(lighthouse._sessions) == 0  # the refused stream opened no session

    # The right token is let in: the lighthouse now sees the replica.
    assert call(addr, methods.LIGHTHOUSE_HEARTBEAT, heartbeat, RIGHT) == (
        pb.LighthouseHeartbeatResponse()
    )
    assert "intruder" in lighthouse.status()["heartbeats"]
    waiting = Background(lambda: call(addr, methods.LIGHTHOUSE_QUORUM, quorum, RIGHT, 3.0))
    wait_until(lambda: lighthouse.status()["waiting"] == ["intruder"], 5, "the request to wait")
    assert waiting.join() == grpc.StatusCode.DEADLINE_EXCEEDED  # min_replicas=2: no quorum


class Lane:
    """A hand-driven connection to the lighthouse's direct lane."""

    def __init__(self, lighthouse: LighthouseServer) -> None:
        self.sock = socket.create_connection(("127.0.0.1", lighthouse.direct_port()), timeout=10)
        self.reader = FrameReader(1 << 20)

    def events_until_closed(
        self, *requests: spb.SessionRequest, then: bytes = b""
    ) -> list[spb.SessionEvent]:
        for r in requests:
            self.sock.sendall(frame(r.SerializeToString()))
        self.sock.sendall(then)
        out = []
        while data := self.sock.recv(65536):
            out.extend(spb.SessionEvent.FromString(e) for e in self.reader.feed(data))
        self.sock.close()
        return out


@pytest.mark.parametrize("token", ["", "not-the-token"], ids=["no-token", "wrong-token"])
def test_the_direct_lane_needs_the_token_in_the_hello(
    lighthouse: LighthouseServer, token: str
) -> None:
    hello = spb.SessionRequest(hello=spb.Hello(replica_id="g0", protocol=1, token=token))
    beat = spb.SessionRequest(heartbeat=spb.Heartbeat(replica_id="g0"))
    events = Lane(lighthouse).events_until_closed(hello, beat)
    assert [e.WhichOneof("kind") for e in events] == ["closed"]
    assert events[0].closed.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    # Skipping the hello does not get around it either.
    events = Lane(lighthouse).events_until_closed(beat)
    assert events[0].closed.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert lighthouse.status()["heartbeats"] == {}
    with pytest.raises(SessionBroken, match="job token"):
        DirectSession("127.0.0.1", lighthouse.direct_port(), "x", 5, SecurityEnv(token=token))


def test_a_refused_peer_reads_why_even_with_bytes_left_unread(lighthouse: LighthouseServer) -> None:
    # The lighthouse ends the session at the hello, while 1 MiB more is on its way: closed with
    # those bytes unread, its socket would answer with a reset, which can reach the peer before
    # the reason does (the peer then sees only "connection reset").
    hello = spb.SessionRequest(hello=spb.Hello(replica_id="g0", protocol=1, token=""))
    events = Lane(lighthouse).events_until_closed(hello, then=bytes(1 << 20))
    assert [e.WhichOneof("kind") for e in events] == ["closed"]
    assert events[0].closed.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert "job token" in events[0].closed.message


def test_clients_with_the_token_use_the_direct_lane_and_the_session(
    lighthouse: LighthouseServer,
) -> None:
    client = LighthouseClient(f"127.0.0.1:{lighthouse.port()}", timedelta(seconds=5))
    try:
        assert client.direct  # Describe was let in
        client.heartbeat("g0")
        assert "g0" in lighthouse.status()["heartbeats"]
    finally:
        client.close()


@pytest.fixture
def manager(job_env: Any) -> Iterator[tuple[ManagerServer, LighthouseServer]]:
    job_env()
    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000)
    server = ManagerServer(
        replica_id="g0",
        lighthouse_addr=f"http://127.0.0.1:{lighthouse.port()}",
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="s:1",
        world_size=2,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=10),
    )
    yield server, lighthouse
    server.shutdown()
    lighthouse.shutdown()


@pytest.mark.parametrize("metadata", REFUSED)
def test_manager_server_refuses_every_service_without_the_job_token(
    manager: tuple[ManagerServer, LighthouseServer],
    metadata: list,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, lighthouse = manager
    # The manager's own session took the direct lane with the token it read from the job's
    # environment: the group is known to the lighthouse.
    assert server._link is not None and server._link.direct
    wait_until(lambda: "g0" in lighthouse.status()["heartbeats"], 5, "the group's heartbeat")
    exits: list[int] = []
    monkeypatch.setattr(manager_server_module.os, "_exit", exits.append)
    addr = f"127.0.0.1:{server.port()}"
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    # Rank 0 (in process) asks for a quorum; the group's request goes to the lighthouse once
    # rank 1 asks too.
    rank0 = Background(
        lambda: server.quorum_in_process(
            QuorumAsk(0, 0, "m", False, False, 0, timedelta(seconds=4))
        )
    )
    quorum = pb.ManagerQuorumRequest(group_rank=1, step=0, checkpoint_metadata="m")
    commit = pb.ShouldCommitRequest(should_commit=True, group_rank=1, step=0)
    assert call(addr, methods.MANAGER_QUORUM, quorum, metadata) == unauthenticated
    assert call(addr, methods.MANAGER_SHOULD_COMMIT, commit, metadata) == unauthenticated
    assert (
        call(
            addr,
            methods.MANAGER_CHECKPOINT_METADATA,
            pb.CheckpointMetadataRequest(rank=0),
            metadata,
        )
        == unauthenticated
    )
    assert call(addr, methods.MANAGER_KILL, pb.KillRequest(msg="bye"), metadata) == (
        unauthenticated
    )
    watch = spb.WatchRequest(group_rank=1)
    assert stream_code(addr, methods.MANAGER_WATCH, [watch], metadata) == unauthenticated
    # The refused request did not complete the group's round: nothing reached the lighthouse.
    assert lighthouse.status()["waiting"] == []
    # ... and the refused vote was not counted: rank 0's own vote alone cannot decide.
    with pytest.raises(TimeoutError):
        server.should_commit_in_process(0, 0, True, timedelta(milliseconds=500))

    # With the token: the kill is obeyed (its exit is the only one, so the refused kill
    # above, which would have been scheduled first, never was) and a quorum request goes on
    # to the lighthouse.
    assert call(addr, methods.MANAGER_KILL, pb.KillRequest(msg="bye"), RIGHT) == (pb.KillResponse())
    wait_until(lambda: exits, 5, "the kill's exit")
    assert exits == [1]
    accepted = Background(lambda: call(addr, methods.MANAGER_QUORUM, quorum, RIGHT, 2.0))
    wait_until(lambda: lighthouse.status()["waiting"] == ["g0"], 5, "g0's request to wait")
    assert accepted.join() == grpc.StatusCode.DEADLINE_EXCEEDED  # min_replicas=2
    with pytest.raises(RuntimeError, match="no quorum within"):  # its request timed out there
        rank0.join()


def test_in_process_calls_need_no_token(manager: tuple[ManagerServer, LighthouseServer]) -> None:
    # Group rank 0 talks to its own server in process (no metadata, nothing to refuse);
    # rank 1 votes over gRPC with the token; the vote completes.
    server, _ = manager
    vote = Background(lambda: server.should_commit_in_process(0, 0, True, timedelta(seconds=5)))
    remote = call(
        f"127.0.0.1:{server.port()}",
        methods.MANAGER_SHOULD_COMMIT,
        pb.ShouldCommitRequest(should_commit=True, group_rank=1, step=0),
        RIGHT,
    )
    assert remote.should_commit is True
    assert vote.join() is True
