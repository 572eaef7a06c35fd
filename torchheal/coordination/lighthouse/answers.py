"""An issued quorum as the lighthouse sends it: its bytes, made once per round from pieces.

Every waiter gets the same quorum, so it is serialized once per round, from each member's message
serialized once when it joined, and each answer's envelope is spliced around it (far cheaper than
building N messages of N copied members). Tests check every piece against the generated classes.
"""

from __future__ import annotations

from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.splice import int_field, message_field, uint_field, varint
from torchheal.coordination import convert
from torchheal.coordination.types import Quorum

__all__ = ["Issued", "member_entry", "quorum_bytes"]

# SessionEvent field 2 (QuorumIssued, length-delimited), and in it field 2 (the quorum).
_EVENT_QUORUM_TAG = varint(2 << 3 | 2)
_ISSUED_QUORUM = 2

# torchft.Quorum: quorum_id = 1, participants = 2, created = 3; google.protobuf.Timestamp:
# seconds = 1, nanos = 2.
_QUORUM_ID, _PARTICIPANT, _CREATED = 1, 2, 3


def member_entry(raw: pb.QuorumMember) -> bytes:
    """``raw`` as received (unknown fields kept), as one participant of a ``torchft.Quorum``."""
    return message_field(_PARTICIPANT, raw.SerializeToString())


def quorum_bytes(quorum: Quorum, entries: dict[str, bytes]) -> bytes:
    """The serialized ``torchft.Quorum`` of ``quorum``, built from pieces.

    ``entries`` maps replica_id -> :func:`member_entry` of its message; a member without one is
    converted from the value.
    """
    parts = [int_field(_QUORUM_ID, quorum.quorum_id)]
    for member in quorum.participants:
        entry = entries.get(member.replica_id)
        if entry is None:
            entry = member_entry(convert.member_to_pb(member))
        parts.append(entry)
    created = quorum.created
    parts.append(
        message_field(_CREATED, int_field(1, created.seconds) + int_field(2, created.nanos))
    )
    return b"".join(parts)


class Issued:
    """An issued quorum as its waiters need it, serialized once for all of them."""

    __slots__ = ("_heads", "_unary", "issued_tail", "member_ids", "quorum_bytes", "quorum_id")

    def __init__(self, quorum_id: int, member_ids: frozenset[str], quorum_bytes: bytes) -> None:
        self.quorum_id = quorum_id
        self.member_ids = member_ids
        self.quorum_bytes = quorum_bytes
        #: The quorum as field 2 of a ``QuorumIssued`` (what follows the request id).
        self.issued_tail = message_field(_ISSUED_QUORUM, quorum_bytes)
        # Event head before a request id, by the id's encoded length.
        self._heads: dict[int, bytes] = {}
        self._unary: bytes | None = None

    @property
    def unary_response(self) -> bytes:
        """A serialized ``LighthouseQuorumResponse`` around the quorum."""
        if self._unary is None:
            self._unary = message_field(1, self.quorum_bytes)
        return self._unary

    def session_event(self, request_id: int) -> bytes:
        """The serialized ``SessionEvent`` answering a session's request ``request_id``."""
        request = uint_field(1, request_id)
        head = self._heads.get(len(request))
        if head is None:
            head = _EVENT_QUORUM_TAG + varint(len(request) + len(self.issued_tail))
            self._heads[len(request)] = head
        return b"".join((head, request, self.issued_tail))
