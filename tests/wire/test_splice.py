"""The hand-assembled envelopes around a serialized quorum parse as the generated classes say."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.splice import message_field, uint_field


def _quorum(n: int, quorum_id: int) -> pb.Quorum:
    return pb.Quorum(
        quorum_id=quorum_id,
        participants=[pb.QuorumMember(replica_id=f"r{i}", step=i * 1000) for i in range(n)],
    )


@given(
    n=st.integers(0, 300),
    quorum_id=st.integers(0, 2**63 - 1),
    request_id=st.integers(0, 2**64 - 1),
)
def test_envelopes_parse_as_the_generated_messages(n: int, quorum_id: int, request_id: int) -> None:
    quorum = _quorum(n, quorum_id)
    payload = quorum.SerializeToString()

    unary = pb.LighthouseQuorumResponse.FromString(message_field(1, payload))
    assert unary == pb.LighthouseQuorumResponse(quorum=quorum)

    issued = message_field(2, uint_field(1, request_id) + message_field(2, payload))
    event = spb.SessionEvent.FromString(issued)
    assert event == spb.SessionEvent(quorum=spb.QuorumIssued(request_id=request_id, quorum=quorum))
    # Same bytes as the generated serializer (fields in number order, zero omitted).
    assert issued == event.SerializeToString()


def test_negative_varint_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="unsigned"):
        uint_field(1, -1)
