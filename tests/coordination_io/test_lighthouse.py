"""The lighthouse server over real gRPC: quorums, heartbeats, unknown-field echo, status."""

from __future__ import annotations

import re
from datetime import timedelta

import grpc
import pytest

from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseClient
from torchheal.coordination.rpc.channels import UnaryCaller, connect
from torchheal.coordination.rpc.errors import RPCError

from .helpers import Background, loopback, raw_call, wait_until

T = timedelta(seconds=10)


def client(server) -> LighthouseClient:
    return LighthouseClient(loopback(server), connect_timeout=timedelta(seconds=5))


def test_address_names_host_and_port(make_lighthouse):
    import socket

    server = make_lighthouse()
    assert server.address() == f"http://{socket.gethostname()}:{server.port()}"


def test_single_replica_gets_quorum_with_data_and_options(make_lighthouse):
    server = make_lighthouse(min_replicas=1)
    quorum = client(server).quorum(
        replica_id="lighthouse_test",
        timeout=T,
        address="http://manager:1",
        store_address="store:2",
        step=10,
        world_size=3,
        shrink_only=False,
        data={"my_data": 1234},
    )
    assert quorum.quorum_id == 1
    (member,) = quorum.participants
    assert member.replica_id == "lighthouse_test"
    assert member.address == "http://manager:1"
    assert member.store_address == "store:2"
    assert member.step == 10
    assert member.world_size == 3
    assert member.data == {"my_data": 1234}
    assert quorum.created.seconds > 0


def test_stable_membership_keeps_id_and_commit_failures_bump_it(make_lighthouse):
    server = make_lighthouse(min_replicas=2)
    call = UnaryCaller(
        connect(loopback(server), timedelta(seconds=5), SecurityEnv()),
        methods.LIGHTHOUSE_QUORUM,
        "lh",
    )

    def request(replica_id: str, commit_failures: int = 0):
        member = pb.QuorumMember(replica_id=replica_id, commit_failures=commit_failures)
        return Background(lambda: call(pb.LighthouseQuorumRequest(requester=member), T))

    ids = []
    for failures in (0, 0, 2):
        a, b = request("replica0"), request("replica1", failures)
        qa, qb = a.join().quorum, b.join().quorum
        assert qa == qb
        assert [m.replica_id for m in qa.participants] == ["replica0", "replica1"]
        ids.append(qa.quorum_id)
    assert ids == [1, 1, 2]


def test_expired_heartbeat_drops_replica(make_lighthouse):
    server = make_lighthouse(min_replicas=1, heartbeat_timeout_ms=200)
    c = client(server)
    first = c.quorum(replica_id="rep0", timeout=T)
    assert [m.replica_id for m in first.participants] == ["rep0"]
    wait_until(
        lambda: server.status()["heartbeats"].get("rep0", 0.0) >= 0.2, what="rep0 to age out"
    )
    second = c.quorum(replica_id="probe", timeout=T)
    assert [m.replica_id for m in second.participants] == ["probe"]
    assert second.quorum_id == 2


def test_heartbeat_rpc_is_recorded(make_lighthouse):
    server = make_lighthouse()
    client(server).heartbeat("hb-replica")
    assert "hb-replica" in server.status()["heartbeats"]


def test_timeout_maps_to_timeout_error_with_reference_text(make_lighthouse):
    server = make_lighthouse(min_replicas=2)
    with pytest.raises(TimeoutError, match=r"status: Cancelled, message.*Timeout expired"):
        client(server).quorum(replica_id="lonely", timeout=timedelta(milliseconds=50))
    # Deliberate difference: the client's session withdraws the request that timed out (the
    # reference's lighthouse keeps it until the round is decided, so a later quorum could
    # include a requester nobody waits for).
    status = server.status()
    assert status["waiting"] == []
    assert status["reason"].startswith(
        "New quorum not ready, only have 0 participants, need min_replicas 2"
    )


def test_missing_requester_is_invalid_argument(make_lighthouse):
    server = make_lighthouse()
    call = UnaryCaller(
        connect(loopback(server), timedelta(seconds=5), SecurityEnv()),
        methods.LIGHTHOUSE_QUORUM,
        "lh",
    )
    with pytest.raises(RPCError, match="missing requester") as info:
        call(pb.LighthouseQuorumRequest(), T)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(info.value, RuntimeError)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def test_unknown_fields_of_a_newer_peer_are_echoed(make_lighthouse):
    server = make_lighthouse(min_replicas=2)
    # A "newer" peer: a QuorumMember with field 99 (a string) that our proto does not know.
    extra = _varint(99 << 3 | 2) + _varint(len(b"future")) + b"future"
    member = pb.QuorumMember(replica_id="newer", step=3).SerializeToString() + extra
    request = _varint(1 << 3 | 2) + _varint(len(member)) + member
    newer = Background(
        lambda: raw_call(loopback(server), methods.LIGHTHOUSE_QUORUM.path, request, timeout=10)
    )
    older = Background(lambda: client(server).quorum(replica_id="older", timeout=T))
    code, payload = newer.join()
    assert code == grpc.StatusCode.OK, payload
    response = pb.LighthouseQuorumResponse.FromString(payload)
    echoed = {m.replica_id: m for m in response.quorum.participants}
    assert extra in echoed["newer"].SerializeToString()
    assert echoed["newer"].step == 3
    # The older peer sees the member too (its client just ignores the unknown field).
    assert [m.replica_id for m in older.join().participants] == ["newer", "older"]


def test_requester_left_out_is_requeued_and_served_next_round(make_lighthouse):
    # Reference test lighthouse_join_during_shrink: a shrink-only round excludes a newcomer,
    # which keeps waiting and joins the next normal round.
    server = make_lighthouse(min_replicas=1, join_timeout_ms=100)
    c = client(server)
    assert [m.replica_id for m in c.quorum(replica_id="a", timeout=T).participants] == ["a"]
    newcomer = Background(lambda: c.quorum(replica_id="c", timeout=T))
    wait_until(lambda: "c" in server.status()["waiting"], what="c to wait")
    shrink = c.quorum(replica_id="a", timeout=T, shrink_only=True)
    assert [m.replica_id for m in shrink.participants] == ["a"]
    wait_until(lambda: "c" in server.status()["waiting"], what="c to be requeued")
    grown = c.quorum(replica_id="a", timeout=T)
    assert [m.replica_id for m in grown.participants] == ["a", "c"]
    assert newcomer.join() == grown


def test_status_snapshot(make_lighthouse):
    server = make_lighthouse(min_replicas=1)
    status = server.status()
    assert status["quorum_id"] == 0
    assert status["prev_quorum"] is None
    client(server).quorum(replica_id="s", timeout=T, step=5, address="http://m:1")
    status = server.status()
    assert status["quorum_id"] == 1
    prev = status["prev_quorum"]
    assert prev["quorum_id"] == 1 and prev["max_step"] == 5
    assert prev["participants"][0]["address"] == "http://m:1"
    assert set(status["heartbeats"]) == {"s"}
    assert status["config"]["min_replicas"] == 1
    assert re.search(r"\[\d+ heartbeating\]", status["reason"])


def test_issued_quorums_are_logged(make_lighthouse, caplog):
    caplog.set_level("INFO", logger="torchheal.coordination.lighthouse")
    server = make_lighthouse(min_replicas=1)
    client(server).quorum(replica_id="logged", timeout=T)
    messages = [r.getMessage() for r in caplog.records]
    assert any("Issued quorum 1" in m and "logged" in m for m in messages)
    assert any(m.startswith("Quorum status: Valid quorum found") for m in messages)
