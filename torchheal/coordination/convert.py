"""Conversion between protobuf messages of the wire and the plain value types of ``types.py``.

The pure cores never see protobuf; servers and clients call these functions at the edge.
Conventions: ``QuorumMember.data`` is a JSON object on the wire (string field 7) and a ``dict``
in Python, with ``""`` <-> ``None``; proto3 ``optional`` fields map to ``None`` when unset.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.types import (
    Notice,
    NoticeKind,
    Quorum,
    QuorumAsk,
    QuorumMember,
    QuorumResult,
    Timestamp,
)

__all__ = [
    "data_from_wire",
    "data_to_wire",
    "group_data",
    "member_from_pb",
    "member_to_pb",
    "notice_from_pb",
    "quorum_ask_from_pb",
    "quorum_ask_to_pb",
    "quorum_from_pb",
    "quorum_result_from_pb",
    "quorum_result_to_pb",
    "quorum_to_pb",
    "timestamp_from_pb",
    "timestamp_to_pb",
]

_T = TypeVar("_T")


# A frozen dataclass's __init__ is slow (object.__setattr__ per field) and decoding builds one per
# member per request: fill __dict__ directly, every field named (tests check dataclasses.fields).
_new_instance = object.__new__


def _filled(cls: type[_T], fields: dict[str, Any]) -> _T:
    value = _new_instance(cls)
    value.__dict__.update(fields)
    return value


def data_to_wire(data: dict[str, Any] | None) -> str:
    """Encode a member's ``data`` (a JSON-serialisable dict, or None as ``""``) for the wire."""
    if data is None:
        return ""
    if not isinstance(data, dict):
        raise TypeError(f"data must be a dict or None, got {type(data).__name__}")
    return json.dumps(data)


def data_from_wire(text: str) -> dict[str, Any] | None:
    """Decode a member's ``data`` (``""``: None); ``ValueError`` if it is not a JSON object."""
    if text == "":
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        # RecursionError: nesting deeper than the parser's stack (a hostile or broken peer).
        raise ValueError(f"QuorumMember.data is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"QuorumMember.data must be a JSON object, got {type(value).__name__}")
    return value


#: The most characters of JSON a manager server passes on as its group's ``data``: the
#: divergence-guard report takes about 50; more is not ours, and would ride in every request.
MAX_GROUP_DATA_CHARS = 1024


def group_data(data: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """A rank's ``data`` (dict, or JSON text over gRPC) as its manager server passes it on.

    None when there is none, it is not a JSON object, or it is too long: never an error.
    """
    try:
        text = data if isinstance(data, str) else data_to_wire(data)
        if len(text) > MAX_GROUP_DATA_CHARS:
            return None
        return data_from_wire(text)
    except (TypeError, ValueError):
        return None


def timestamp_to_pb(ts: Timestamp) -> timestamp_pb2.Timestamp:
    """Convert a :class:`Timestamp` to ``google.protobuf.Timestamp``."""
    return timestamp_pb2.Timestamp(seconds=ts.seconds, nanos=ts.nanos)


def timestamp_from_pb(msg: timestamp_pb2.Timestamp) -> Timestamp:
    """Convert ``google.protobuf.Timestamp`` to a :class:`Timestamp`."""
    return _filled(Timestamp, {"seconds": msg.seconds, "nanos": msg.nanos})


def member_to_pb(member: QuorumMember) -> pb.QuorumMember:
    """Convert a :class:`QuorumMember` to its protobuf message (``TypeError``: bad ``data``)."""
    return pb.QuorumMember(
        replica_id=member.replica_id,
        address=member.address,
        store_address=member.store_address,
        step=member.step,
        world_size=member.world_size,
        shrink_only=member.shrink_only,
        data=data_to_wire(member.data),
        commit_failures=member.commit_failures,
    )


def member_from_pb(msg: pb.QuorumMember, *, strict_data: bool = True) -> QuorumMember:
    """Convert a protobuf ``QuorumMember`` to the value type.

    ``data`` that is not a JSON object raises ``ValueError``, or becomes None if not
    ``strict_data`` (the lighthouse treats ``data`` as opaque and echoes the raw message).
    """
    data = msg.data
    if data:
        try:
            data = data_from_wire(data)
        except ValueError:
            if strict_data:
                raise
            data = None
    else:
        data = None
    return _filled(
        QuorumMember,
        {
            "replica_id": msg.replica_id,
            "address": msg.address,
            "store_address": msg.store_address,
            "step": msg.step,
            "world_size": msg.world_size,
            "shrink_only": msg.shrink_only,
            "data": data,
            "commit_failures": msg.commit_failures,
        },
    )


def quorum_to_pb(
    quorum: Quorum, raw_members: dict[str, pb.QuorumMember] | None = None
) -> pb.Quorum:
    """Convert a :class:`Quorum` to its protobuf message.

    ``raw_members``: replica_id -> the member exactly as that replica sent it, used in place of
    a fresh conversion so that fields unknown to us (from newer peers) are echoed untouched.
    """
    raw_members = raw_members or {}
    msg = pb.Quorum(quorum_id=quorum.quorum_id, created=timestamp_to_pb(quorum.created))
    for member in quorum.participants:
        raw = raw_members.get(member.replica_id)
        msg.participants.append(raw if raw is not None else member_to_pb(member))
    return msg


def quorum_from_pb(msg: pb.Quorum, *, strict_data: bool = True) -> Quorum:
    """Convert a protobuf ``Quorum`` to the value type.

    Not ``strict_data``: a member whose ``data`` is not a JSON object gets None instead of a
    ``ValueError`` (another group's opaque data must not make a quorum unusable).
    """
    return _filled(
        Quorum,
        {
            "quorum_id": msg.quorum_id,
            "participants": tuple(
                [member_from_pb(m, strict_data=strict_data) for m in msg.participants]
            ),
            "created": timestamp_from_pb(msg.created),
        },
    )


def quorum_result_to_pb(result: QuorumResult) -> pb.ManagerQuorumResponse:
    """Convert a :class:`QuorumResult` to ``ManagerQuorumResponse``.

    ``replica_ids`` travels in field 13, as in newer reference wheels (older peers skip it).
    """
    msg = pb.ManagerQuorumResponse(
        quorum_id=result.quorum_id,
        recover_src_manager_address=result.recover_src_manager_address,
        recover_dst_replica_ranks=list(result.recover_dst_replica_ranks),
        store_address=result.store_address,
        max_step=result.max_step,
        max_world_size=result.max_world_size,
        replica_rank=result.replica_rank,
        replica_world_size=result.replica_world_size,
        heal=result.heal,
        commit_failures=result.commit_failures,
        replica_ids=list(result.replica_ids),
    )
    if result.recover_src_replica_rank is not None:
        msg.recover_src_replica_rank = result.recover_src_replica_rank
    if result.max_replica_rank is not None:
        msg.max_replica_rank = result.max_replica_rank
    return msg


def quorum_result_from_pb(msg: pb.ManagerQuorumResponse) -> QuorumResult:
    """Convert ``ManagerQuorumResponse`` to a :class:`QuorumResult`."""
    return QuorumResult(
        quorum_id=msg.quorum_id,
        replica_rank=msg.replica_rank,
        replica_world_size=msg.replica_world_size,
        recover_src_manager_address=msg.recover_src_manager_address,
        recover_src_replica_rank=(
            msg.recover_src_replica_rank if msg.HasField("recover_src_replica_rank") else None
        ),
        recover_dst_replica_ranks=list(msg.recover_dst_replica_ranks),
        store_address=msg.store_address,
        max_step=msg.max_step,
        max_replica_rank=msg.max_replica_rank if msg.HasField("max_replica_rank") else None,
        max_world_size=msg.max_world_size,
        heal=msg.heal,
        commit_failures=msg.commit_failures,
        replica_ids=list(msg.replica_ids),
    )


def quorum_ask_to_pb(ask: QuorumAsk) -> pb.ManagerQuorumRequest:
    """Convert a :class:`QuorumAsk` to its request (its timeout is the call's deadline)."""
    return pb.ManagerQuorumRequest(
        group_rank=ask.group_rank,
        step=ask.step,
        checkpoint_metadata=ask.checkpoint_metadata,
        shrink_only=ask.shrink_only,
        init_sync=ask.init_sync,
        commit_failures=ask.commit_failures,
        data=data_to_wire(ask.data),
    )


def quorum_ask_from_pb(msg: pb.ManagerQuorumRequest, timeout: timedelta) -> QuorumAsk:
    """Convert a ``ManagerQuorumRequest`` and the call's deadline to a :class:`QuorumAsk`."""
    return QuorumAsk(
        group_rank=msg.group_rank,
        step=msg.step,
        checkpoint_metadata=msg.checkpoint_metadata,
        shrink_only=msg.shrink_only,
        init_sync=msg.init_sync,
        commit_failures=msg.commit_failures,
        timeout=timeout,
        data=group_data(msg.data),
    )


def notice_from_pb(lost: spb.MemberLost, own_replica_id: str) -> Notice:
    """The one decoding of a ``MemberLost`` notice, as heard by group ``own_replica_id``."""
    if lost.replica_id != own_replica_id:
        kind = NoticeKind.LOST
    elif lost.gave_up:
        kind = NoticeKind.GAVE_UP
    elif lost.superseded_by:
        kind = NoticeKind.SUPERSEDED
    else:
        kind = NoticeKind.DROPPED
    return Notice(
        kind,
        lost.replica_id,
        lost.quorum_id,
        lost.reason,
        bool(lost.gave_up),
        steps_done=max(0, lost.steps_done),
    )
