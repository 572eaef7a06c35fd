"""Hostile or malformed requests get a clear status, and the servers keep serving."""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest

from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseClient, ManagerClient

from .helpers import Background, loopback, raw_call, wait_until

T = timedelta(seconds=10)
GARBAGE = b"\xff\xff\xff\xff\x0f\x0a\x05abc"  # bad tag and a truncated length-delimited field

LIGHTHOUSE_METHODS = [methods.LIGHTHOUSE_QUORUM, methods.LIGHTHOUSE_HEARTBEAT]
MANAGER_METHODS = [
    methods.MANAGER_QUORUM,
    methods.MANAGER_CHECKPOINT_METADATA,
    methods.MANAGER_SHOULD_COMMIT,
    methods.MANAGER_KILL,
]


@pytest.fixture
def servers(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse), world_size=2)
    return lighthouse, manager


def assert_still_serving(lighthouse, manager) -> None:
    LighthouseClient(loopback(lighthouse), timedelta(seconds=5)).heartbeat("alive")
    c = ManagerClient(manager.address(), timedelta(seconds=5))
    votes = [Background(lambda r=r: c.should_commit(r, 1_000, True, T)) for r in range(2)]
    assert [v.join() for v in votes] == [True, True]


@pytest.mark.parametrize("method", LIGHTHOUSE_METHODS + MANAGER_METHODS, ids=lambda m: m.path)
def test_garbage_bytes_are_invalid_argument(servers, method):
    lighthouse, manager = servers
    server = lighthouse if method in LIGHTHOUSE_METHODS else manager
    code, details = raw_call(loopback(server), method.path, GARBAGE)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"cannot parse {method.request.DESCRIPTOR.name}" in details
    LighthouseClient(loopback(lighthouse), timedelta(seconds=5)).heartbeat("alive")


def test_unknown_method_is_unimplemented(servers):
    lighthouse, _ = servers
    code, _ = raw_call(loopback(lighthouse), "/torchft.LighthouseService/Nope", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED
    code, _ = raw_call(loopback(lighthouse), methods.MANAGER_QUORUM.path, b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (pb.QuorumMember(), "missing requester.replica_id"),
        (pb.QuorumMember(replica_id="a", step=-1), "step must be >= 0"),
        (pb.QuorumMember(replica_id="a", commit_failures=-3), "commit_failures must be >= 0"),
    ],
)
def test_lighthouse_rejects_impossible_members(servers, member, message):
    lighthouse, _ = servers
    request = pb.LighthouseQuorumRequest(requester=member).SerializeToString()
    code, details = raw_call(loopback(lighthouse), methods.LIGHTHOUSE_QUORUM.path, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in details
    assert lighthouse.status()["waiting"] == []


def test_lighthouse_heartbeat_without_id(servers):
    lighthouse, _ = servers
    code, details = raw_call(loopback(lighthouse), methods.LIGHTHOUSE_HEARTBEAT.path, b"")
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "missing replica_id")


def test_lighthouse_tolerates_huge_world_size_and_opaque_data(make_lighthouse):
    # Alone: with the fixture's manager heartbeating, a lone requester would wait (split brain).
    lighthouse = make_lighthouse(min_replicas=1)
    # uint64 max is what a peer that encodes world_size=-1 as a varint would send.
    member = pb.QuorumMember(replica_id="odd", world_size=2**64 - 1, data="not json")
    request = pb.LighthouseQuorumRequest(requester=member).SerializeToString()
    code, payload = raw_call(loopback(lighthouse), methods.LIGHTHOUSE_QUORUM.path, request)
    assert code == grpc.StatusCode.OK
    (echoed,) = pb.LighthouseQuorumResponse.FromString(payload).quorum.participants
    assert echoed.world_size == 2**64 - 1 and echoed.data == "not json"


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.ManagerQuorumRequest(group_rank=-1), "group_rank -1 is outside [0, 2)"),
        (pb.ManagerQuorumRequest(group_rank=2), "group_rank 2 is outside [0, 2)"),
        (pb.ManagerQuorumRequest(group_rank=0, step=-5), "step must be >= 0"),
        (pb.ManagerQuorumRequest(group_rank=0, commit_failures=-1), "commit_failures must be"),
    ],
)
def test_manager_rejects_impossible_quorum_requests(servers, request_, message):
    lighthouse, manager = servers
    code, details = raw_call(
        loopback(manager), methods.MANAGER_QUORUM.path, request_.SerializeToString()
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in details
    assert_still_serving(lighthouse, manager)


@pytest.mark.parametrize("rank", [-1, 2, 2**62])
def test_manager_rejects_votes_from_unknown_ranks(servers, rank):
    lighthouse, manager = servers
    request = pb.ShouldCommitRequest(group_rank=rank, step=1, should_commit=True)
    code, details = raw_call(
        loopback(manager), methods.MANAGER_SHOULD_COMMIT.path, request.SerializeToString()
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"group_rank {rank} is outside" in details
    assert_still_serving(lighthouse, manager)


def test_client_cancelling_mid_call_leaves_servers_healthy(servers):
    lighthouse, manager = servers
    c = ManagerClient(manager.address(), timedelta(seconds=5))
    # A quorum call waiting for the second rank, cancelled by the client.
    with grpc.insecure_channel(loopback(manager)) as channel:
        call = channel.unary_unary(
            methods.MANAGER_QUORUM.path,
            request_serializer=pb.ManagerQuorumRequest.SerializeToString,
            response_deserializer=pb.ManagerQuorumResponse.FromString,
        )
        future = call.future(pb.ManagerQuorumRequest(group_rank=0, step=1), timeout=30)
        assert future.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            future.result()
    # A lighthouse quorum call from a client that goes away mid-call.
    with grpc.insecure_channel(loopback(lighthouse)) as channel:
        call = channel.unary_unary(methods.LIGHTHOUSE_QUORUM.path)
        request = pb.LighthouseQuorumRequest(
            requester=pb.QuorumMember(replica_id="gone", step=1)
        ).SerializeToString()
        lh_future = call.future(request, timeout=30)
    # Closing the channel cancelled it.
    with pytest.raises((grpc.FutureCancelledError, grpc.RpcError)):
        lh_future.result(timeout=10)
    # Both servers still complete normal rounds.
    results = [Background(lambda r=r: c._quorum(r, 3, "", False, False, 0, T)) for r in range(2)]
    assert [r.join().max_step for r in results] == [3, 3]
    wait_until(lambda: "gone" not in lighthouse.status()["waiting"], what="round to clear")
    assert_still_serving(lighthouse, manager)
