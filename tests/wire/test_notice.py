"""A lighthouse's ``MemberLost`` notice is decoded once, into what it means to the group hearing it."""

from __future__ import annotations

import pytest

from torchheal._wire import session_pb2 as spb
from torchheal.coordination.convert import notice_from_pb
from torchheal.coordination.types import Notice, NoticeKind

OWN = "a:1"


@pytest.mark.parametrize(
    ("lost", "kind"),
    [
        (spb.MemberLost(replica_id="b:1", quorum_id=3, reason="connection ended"), NoticeKind.LOST),
        (spb.MemberLost(replica_id="b:1", quorum_id=3, reason="x", gave_up=True), NoticeKind.LOST),
        (spb.MemberLost(replica_id=OWN, quorum_id=3, reason="x", gave_up=True), NoticeKind.GAVE_UP),
        (
            spb.MemberLost(replica_id=OWN, quorum_id=3, reason="x", superseded_by=4),
            NoticeKind.SUPERSEDED,
        ),
        (
            spb.MemberLost(replica_id=OWN, quorum_id=3, reason="heartbeat expired"),
            NoticeKind.DROPPED,
        ),
    ],
)
def test_each_notice_has_one_meaning_for_the_group_that_hears_it(
    lost: spb.MemberLost, kind: NoticeKind
) -> None:
    assert notice_from_pb(lost, OWN) == Notice(
        kind, lost.replica_id, lost.quorum_id, lost.reason, gave_up=lost.gave_up
    )
