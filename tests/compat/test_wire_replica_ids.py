"""``ManagerQuorumResponse.replica_ids`` (field 13 of newer reference wheels) on the wire.

Newer torchft wheels read ``QuorumResult.replica_ids`` from the manager's quorum response
(torchtitan's newer versions use it). These tests pin the field number against bytes the
reference itself produced, and show a reference client getting the field from a torchheal
manager server, and every rank of a torchheal group seeing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import grpc
import pytest

import torchheal.coordination as heal_mod
from tests.interop.helpers import CONNECT, Cluster, Impl, gather, loopback, manager_quorum
from tests.reference import import_reference
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.types import QuorumAsk

ref_mod = import_reference("torchft.coordination")

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]

HEAL = Impl("torchheal", heal_mod)
REF = Impl("reference", ref_mod)
TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def test_reference_manager_sends_replica_ids_in_field_13(cluster: Cluster) -> None:
    """Raw bytes from a reference ManagerServer decode as replica_ids with torchheal's proto."""
    _, lh_addr = cluster.lighthouse(REF, min_replicas=1)
    server = cluster.manager(REF, "replica_7:abc", lh_addr, "store:1", 1)
    channel = grpc.insecure_channel(loopback(server).removeprefix("http://"))
    try:
        call = channel.unary_unary(
            "/torchft.ManagerService/Quorum",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=lambda b: b,
        )
        raw = call(pb.ManagerQuorumRequest(group_rank=0, step=3, init_sync=True), timeout=10)
    finally:
        channel.close()
    # Tag of field 13, length-delimited: (13 << 3) | 2 = 0x6a, then the string's length.
    assert b"\x6a\x0dreplica_7:abc" in raw
    assert list(pb.ManagerQuorumResponse.FromString(raw).replica_ids) == ["replica_7:abc"]


def test_reference_client_gets_replica_ids_from_torchheal_manager(cluster: Cluster) -> None:
    _, lh_addr = cluster.lighthouse(HEAL, min_replicas=2)
    ids = ["replica_0:u0", "replica_1:u1"]
    clients = [
        REF.mod.ManagerClient(cluster.manager(HEAL, rid, lh_addr, f"s{i}:1", 1).address(), CONNECT)
        for i, rid in enumerate(ids)
    ]
    futures = [
        cluster.submit(manager_quorum, REF, c, 0, 1, "", False, False, 0, TIMEOUT, rid)
        for c, rid in zip(clients, ids, strict=True)
    ]
    results = gather(futures)
    assert [list(r.replica_ids) for r in results] == [ids, ids]


def test_every_rank_of_a_torchheal_group_sees_replica_ids(cluster: Cluster) -> None:
    """Group rank 0 asks in-process, rank 1 over gRPC: both get the ids."""
    _, lh_addr = cluster.lighthouse(HEAL, min_replicas=1)
    server = cluster.manager(HEAL, "solo:u", lh_addr, "s:1", 2)
    client = HEAL.mod.ManagerClient(loopback(server), CONNECT)
    local = cluster.submit(server.quorum_in_process, QuorumAsk(0, 0, "", False, False, 0, TIMEOUT))
    remote = cluster.submit(manager_quorum, HEAL, client, 1, 0, "", False, False, 0, TIMEOUT)
    assert [list(r.replica_ids) for r in gather([local, remote])] == [["solo:u"], ["solo:u"]]
