"""A group's divergence-guard report in its quorum requests' ``data``: written by group rank 0,
bounded by its manager server, and read tolerantly: anyone else's data is ignored, never an error.
"""

from __future__ import annotations

import json

import pytest

from torchheal.coordination import convert
from torchheal.coordination.guard_report import GuardReport, from_data
from torchheal.coordination.round import QuorumRound
from torchheal.coordination.types import QuorumMember

REPORT = {"verified": 41, "checks": 5, "mismatches": 1}


def test_a_report_round_trips_through_the_wire() -> None:
    report = GuardReport(verified=-1, checks=0, mismatches=0)
    assert from_data(report.to_data()) == report
    text = convert.data_to_wire(GuardReport(41, 5, 1).to_data())
    assert len(text) < 60  # short keys: it rides in every request
    assert from_data(convert.data_from_wire(text)) == GuardReport(41, 5, 1)
    # Keys of someone else's beside ours do not hide the report.
    assert from_data({**REPORT, "user": [1, 2]}) == GuardReport(41, 5, 1)


@pytest.mark.parametrize(
    "data",
    [
        None,
        "verified",
        [REPORT],
        {},
        {"step": 3},  # a user's data
        {"verified": 41, "checks": 5},  # a key missing
        {**REPORT, "verified": "41"},
        {**REPORT, "checks": 5.0},
        {**REPORT, "mismatches": True},  # bool is an int in Python, not a count
        {**REPORT, "verified": -2},
        {**REPORT, "mismatches": -1},
        {**REPORT, "mismatches": 6},  # more mismatches than checks
        {**REPORT, "checks": 2**64},
        {**REPORT, "verified": {"nested": REPORT}},
        {"verified": "x" * 1_000_000, "checks": 1, "mismatches": 0},  # huge
    ],
    ids=lambda d: repr(d)[:40],
)
def test_foreign_or_malformed_data_is_ignored(data: object) -> None:
    assert from_data(data) is None


def test_the_manager_server_passes_on_bounded_json_objects_only() -> None:
    assert convert.group_data(REPORT) == REPORT
    assert convert.group_data(json.dumps(REPORT)) == REPORT  # as it arrives over gRPC
    too_long = {"pad": "x" * convert.MAX_GROUP_DATA_CHARS}
    for bad in (None, "", "not json", "[1, 2]", '{"a": ' * 100_000, too_long, {"x": object()}):
        assert convert.group_data(bad) is None  # type: ignore[arg-type]


def test_the_request_message_carries_the_data_beside_the_references_fields() -> None:
    from datetime import timedelta

    from torchheal.coordination.types import QuorumAsk

    ask = QuorumAsk(0, 3, "meta", False, True, 0, timedelta(seconds=5), data=REPORT)
    msg = convert.quorum_ask_to_pb(ask)
    assert msg.data == json.dumps(REPORT)
    assert convert.quorum_ask_from_pb(msg, timedelta(seconds=5)) == ask
    # A reference rank sends no data: none is passed on.
    msg.ClearField("data")
    assert convert.quorum_ask_from_pb(msg, timedelta(seconds=5)).data is None


def test_the_groups_data_is_its_rank_0s_whoever_comes_last() -> None:
    def member(data: dict[str, int] | None) -> QuorumMember:
        return QuorumMember("g:1", step=3, world_size=3, data=data)

    round_ = QuorumRound(3)
    assert round_.join(1, member(None), 0.0, 10.0).start is None
    assert round_.join(0, member(REPORT), 0.0, 10.0).start is None
    start = round_.join(2, member({"other": 1}), 0.0, 10.0).start
    assert start is not None and start.member.data == REPORT
    # Rank 0 last: its own.
    round_.join(2, member(None), 1.0, 10.0)
    round_.join(1, member(None), 1.0, 10.0)
    start = round_.join(0, member(REPORT), 1.0, 10.0).start
    assert start is not None and start.member.data == REPORT
