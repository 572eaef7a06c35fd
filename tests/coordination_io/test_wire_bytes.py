"""Messages the lighthouse and its client build from bytes equal the generated classes' own.

The hot paths (an issued quorum, a client's quorum request) assemble protobuf wire bytes from
pieces instead of building messages; each must be byte for byte what the generated class
serializes, for any value the field can hold.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.splice import int_field
from torchheal.coordination import Quorum, QuorumMember, Timestamp, convert
from torchheal.coordination.lighthouse.answers import member_entry, quorum_bytes
from torchheal.coordination.session_client import quorum_request

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=12)


@st.composite
def members(draw: st.DrawFn) -> QuorumMember:
    return QuorumMember(
        replica_id=draw(TEXT.filter(bool)),
        address=draw(TEXT),
        store_address=draw(TEXT),
        step=draw(INT64),
        world_size=draw(UINT64),
        shrink_only=draw(st.booleans()),
        data=draw(st.none() | st.dictionaries(TEXT, st.integers(-5, 5), max_size=2)),
        commit_failures=draw(INT64),
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(members(), max_size=5, unique_by=lambda m: m.replica_id),
    INT64,
    INT64,
    st.integers(-(2**31), 2**31 - 1),
    st.data(),
)
def test_an_issued_quorum_built_from_pieces_equals_the_generated_class(
    participants, quorum_id, seconds, nanos, data
):
    quorum = Quorum(
        quorum_id=quorum_id,
        participants=tuple(participants),
        created=Timestamp(seconds=seconds, nanos=nanos),
    )
    # Some members sent fields unknown to us (echoed as received); some have no message.
    raw: dict[str, pb.QuorumMember] = {}
    for member in participants:
        if data.draw(st.booleans()):
            message = convert.member_to_pb(member)
            if data.draw(st.booleans()):
                unknown = int_field(99, data.draw(INT64)) or b"\xa0\x06\x01"
                message.MergeFromString(unknown)
            raw[member.replica_id] = message
    entries = {rid: member_entry(message) for rid, message in raw.items()}
    expected = convert.quorum_to_pb(quorum, raw).SerializeToString()
    assert quorum_bytes(quorum, entries) == expected


@given(INT64)
def test_signed_fields_built_from_bytes_equal_the_generated_class(value):
    assert int_field(4, value) == pb.QuorumMember(step=value).SerializeToString()


ANY_INT = st.integers(-(2**70), 2**70)


@settings(max_examples=300, deadline=None)
@given(
    request_id=UINT64 | ANY_INT,
    replica_id=st.text(max_size=8) | st.sampled_from(["\ud800", None, 5]),
    address=st.text(max_size=8),
    store_address=st.text(max_size=8),
    step=INT64 | ANY_INT | st.sampled_from([True, 2.0]),
    world_size=UINT64 | ANY_INT,
    shrink_only=st.booleans() | st.sampled_from([0, 1]),
    data=st.text(max_size=8),
    timeout_ms=INT64 | ANY_INT,
)
def test_quorum_requests_built_from_bytes_equal_the_generated_class(**fields):
    # In range, the bytes are the generated classes'; out of range or of the wrong type, the
    # same error (the generated classes are then used to say what is wrong).
    request_id, timeout_ms = fields.pop("request_id"), fields.pop("timeout_ms")
    try:
        expected: bytes | type[Exception] = spb.SessionRequest(
            quorum=spb.QuorumRequest(
                request_id=request_id,
                requester=pb.QuorumMember(**fields),
                timeout_ms=timeout_ms,
            )
        ).SerializeToString()
    except (TypeError, ValueError) as e:
        expected = type(e)
    try:
        got: bytes | type[Exception] = quorum_request(request_id, **fields, timeout_ms=timeout_ms)
    except (TypeError, ValueError) as e:
        got = type(e)
    assert got == expected
