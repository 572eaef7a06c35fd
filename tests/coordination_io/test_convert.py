"""Protobuf <-> value conversions."""

from __future__ import annotations

import pytest

from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import Quorum, QuorumMember, QuorumResult, Timestamp, convert


def test_member_round_trip_with_data():
    member = QuorumMember(
        replica_id="a:1",
        address="http://h:1",
        store_address="h:2",
        step=7,
        world_size=4,
        shrink_only=True,
        data={"my_data": 1234},
        commit_failures=2,
    )
    msg = convert.member_to_pb(member)
    assert msg.data == '{"my_data": 1234}'
    assert convert.member_from_pb(msg) == member


def test_empty_data_is_none():
    assert convert.member_to_pb(QuorumMember("a")).data == ""
    assert convert.member_from_pb(pb.QuorumMember(replica_id="a")).data is None


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "3"])
def test_bad_data_strict_and_lenient(text):
    msg = pb.QuorumMember(replica_id="a", data=text)
    with pytest.raises(ValueError, match="data"):
        convert.member_from_pb(msg)
    assert convert.member_from_pb(msg, strict_data=False).data is None


def test_data_must_be_a_dict():
    with pytest.raises(TypeError, match="dict"):
        convert.data_to_wire([1, 2])  # type: ignore[arg-type]


def test_quorum_round_trip_and_raw_members_are_used():
    quorum = Quorum(
        quorum_id=3,
        participants=(QuorumMember("a", step=1), QuorumMember("b", step=2)),
        created=Timestamp(seconds=10, nanos=5),
    )
    msg = convert.quorum_to_pb(quorum)
    assert convert.quorum_from_pb(msg) == quorum
    raw_a = pb.QuorumMember(replica_id="a", step=1, address="raw")
    msg = convert.quorum_to_pb(quorum, {"a": raw_a})
    assert msg.participants[0].address == "raw"
    assert msg.participants[1].replica_id == "b"


def test_quorum_result_optional_fields():
    empty = QuorumResult()
    msg = convert.quorum_result_to_pb(empty)
    assert not msg.HasField("recover_src_replica_rank")
    assert not msg.HasField("max_replica_rank")
    assert convert.quorum_result_from_pb(msg) == empty

    full = QuorumResult(
        quorum_id=4,
        replica_rank=1,
        replica_world_size=3,
        recover_src_manager_address="http://src:1",
        recover_src_replica_rank=0,
        recover_dst_replica_ranks=[2],
        store_address="s:1",
        max_step=9,
        max_replica_rank=0,
        max_world_size=2,
        heal=True,
        commit_failures=1,
    )
    msg = convert.quorum_result_to_pb(full)
    assert msg.HasField("recover_src_replica_rank") and msg.recover_src_replica_rank == 0
    assert convert.quorum_result_from_pb(msg) == full


def test_timestamp():
    ts = Timestamp(seconds=1_700_000_000, nanos=123)
    assert convert.timestamp_from_pb(convert.timestamp_to_pb(ts)) == ts


def test_decoded_values_have_every_field_as_constructed_ones_do():
    # The decoders fill instances without the dataclasses' __init__: each must still carry
    # exactly the fields the constructor sets (a field added to a type must be decoded too).
    members = (
        QuorumMember("a", "http://h:1", "h:2", 7, 4, True, {"k": 1}, 2),
        QuorumMember("b"),
    )
    quorum = Quorum(quorum_id=5, participants=members, created=Timestamp(10, 20))
    decoded = convert.quorum_from_pb(convert.quorum_to_pb(quorum))
    pairs = [(decoded, quorum), (decoded.created, quorum.created)]
    pairs += zip(decoded.participants, quorum.participants, strict=True)
    for value, constructed in pairs:
        assert type(value) is type(constructed)
        assert vars(value) == vars(constructed)
    assert decoded == quorum and hash(decoded.created) == hash(quorum.created)
