"""LighthouseClient over the lighthouse's direct session lane: the reference's semantics.

Real lighthouses on loopback. Against a torchheal lighthouse the client talks over one
detached session on the direct TCP lane; every result and error must read as the reference's
unary calls read (the same tests pass over unary: ``lane`` parametrizes both). A lane that
cannot be reached, and a lighthouse without one, fall back to the unary calls.
"""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest

from torchheal.coordination import LighthouseClient, LighthouseServer
from torchheal.coordination.rpc.errors import RPCError

from .helpers import Background, loopback, wait_until

T = timedelta(seconds=10)


@pytest.fixture(params=["direct", "unary"])
def lane(request) -> str:
    return request.param


def _lighthouse(make_lighthouse, lane: str, **kwargs) -> LighthouseServer:
    return make_lighthouse(direct_port=0 if lane == "direct" else None, **kwargs)


def _client(server: LighthouseServer, lane: str) -> LighthouseClient:
    client = LighthouseClient(loopback(server), connect_timeout=timedelta(seconds=5))
    assert client.direct == (lane == "direct")
    return client


def test_quorum_carries_every_field_and_the_data(make_lighthouse, lane):
    server = _lighthouse(make_lighthouse, lane)
    quorum = _client(server, lane).quorum(
        replica_id="a",
        timeout=T,
        address="http://manager:1",
        store_address="store:2",
        step=10,
        world_size=3,
        shrink_only=False,
        data={"my_data": [1, "x"]},
    )
    assert quorum.quorum_id == 1
    (member,) = quorum.participants
    assert (member.replica_id, member.address, member.store_address) == (
        "a",
        "http://manager:1",
        "store:2",
    )
    assert (member.step, member.world_size, member.data) == (10, 3, {"my_data": [1, "x"]})
    assert quorum.created.seconds > 0


def test_data_that_is_not_json_is_a_type_error_before_anything_is_sent(make_lighthouse, lane):
    server = _lighthouse(make_lighthouse, lane)
    with pytest.raises(TypeError):
        _client(server, lane).quorum(replica_id="a", timeout=T, data={"x": object()})
    assert server.status()["waiting"] == []


def test_a_quorum_that_does_not_come_is_a_timeout_with_the_reference_text(make_lighthouse, lane):
    server = _lighthouse(make_lighthouse, lane, min_replicas=2)
    with pytest.raises(TimeoutError, match=r'status: Cancelled, message: "Timeout expired"'):
        _client(server, lane).quorum(replica_id="lonely", timeout=timedelta(milliseconds=100))


def test_a_refused_request_is_a_runtime_error_naming_the_problem(make_lighthouse, lane):
    server = _lighthouse(make_lighthouse, lane)
    with pytest.raises(RPCError, match=r"requester\.step must be >= 0") as info:
        _client(server, lane).quorum(replica_id="a", timeout=T, step=-1)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "LighthouseService/Quorum" in str(info.value)
    assert server.status()["waiting"] == []


def test_heartbeats_are_recorded_once_the_call_returns(make_lighthouse, lane):
    server = _lighthouse(make_lighthouse, lane)
    client = _client(server, lane)
    client.heartbeat("hb-replica")
    assert "hb-replica" in server.status()["heartbeats"]
    with pytest.raises(RuntimeError):
        client.heartbeat("")


def test_one_client_serves_several_replicas_and_threads_at_once(make_lighthouse, lane):
    # A call waiting for a quorum must not hold up another thread's calls on the same client,
    # and each call gets its own answer.
    server = _lighthouse(make_lighthouse, lane, min_replicas=2)
    client = _client(server, lane)
    first = Background(lambda: client.quorum(replica_id="a", timeout=T, step=1))
    wait_until(lambda: server.status()["waiting"] == ["a"], what="a to wait")
    for _ in range(20):
        client.heartbeat("b")
    second = Background(lambda: client.quorum(replica_id="b", timeout=T, step=2))
    qa, qb = first.join(), second.join()
    assert qa == qb
    assert [(m.replica_id, m.step) for m in qa.participants] == [("a", 1), ("b", 2)]


def test_closing_a_client_withdraws_its_requests_but_declares_nobody_dead(make_lighthouse):
    # The client's session is detached: liveness comes from heartbeats, as with the reference
    # (a manager server's session is the one whose end is a death certificate).
    server = make_lighthouse(min_replicas=2, heartbeat_timeout_ms=60_000)
    waiting = LighthouseClient(loopback(server), T)
    call = Background(lambda: waiting.quorum(replica_id="a", timeout=timedelta(seconds=60)))
    wait_until(lambda: server.status()["waiting"] == ["a"], what="a to wait")
    waiting.close()
    with pytest.raises(RuntimeError, match="Unavailable"):
        call.join()
    wait_until(lambda: server.status()["waiting"] == [], what="a's request withdrawn")
    assert "a" in server.status()["heartbeats"]


def test_a_lighthouse_that_goes_away_fails_the_waiting_call_at_once(make_lighthouse, lane):
    server = _lighthouse(make_lighthouse, lane, min_replicas=2)
    client = _client(server, lane)
    call = Background(lambda: client.quorum(replica_id="a", timeout=timedelta(seconds=60)))
    wait_until(lambda: server.status()["waiting"] == ["a"], what="a to wait")
    server.shutdown()
    with pytest.raises((RuntimeError, TimeoutError)):
        call.join(timeout=20)


def test_a_lane_that_cannot_be_reached_falls_back_to_unary_calls(make_lighthouse):
    server = make_lighthouse()
    # The lighthouse still announces its lane's port, but nothing answers there any more.
    server._server.submit(server._stop_lane()).result()
    client = LighthouseClient(loopback(server), T)
    quorum = client.quorum(replica_id="a", timeout=T, step=3)
    assert [(m.replica_id, m.step) for m in quorum.participants] == [("a", 3)]
    assert not client.direct
    client.heartbeat("a")
