"""Unit tests of a group's own judgement of whether the lighthouse may have dropped it."""

from __future__ import annotations

import pytest

from torchheal.coordination.standing import Standing, limit_for


def test_the_limit_is_half_the_lighthouse_timeout_and_never_below_two_heartbeats() -> None:
    assert limit_for(5.0, 0.1) == 2.5
    assert limit_for(2.0, 0.1) == 1.0
    assert limit_for(2.0, 0.8) == 1.6
    for bad in [(0.0, 0.1), (2.0, 0.0), (-1.0, 0.1), (float("nan"), 0.1)]:
        with pytest.raises(ValueError, match="must be > 0"):
            limit_for(*bad)


def test_a_loop_ticking_at_its_pace_raises_no_doubt() -> None:
    standing = Standing(limit_s=1.0, now=0.0)
    standing.asked()
    for i in range(1, 50):
        assert standing.tick(i * 0.1) is None
    assert standing.doubt(4.95) is None


def test_a_stall_since_the_request_is_doubted_until_the_next_request() -> None:
    standing = Standing(limit_s=1.0, now=0.0)
    standing.asked()
    assert standing.tick(0.1) is None
    assert standing.tick(1.3) == pytest.approx(1.2)  # a stall of the process
    assert standing.tick(1.4) is None
    why = standing.doubt(1.45)
    assert why is not None and "1.20s" in why
    assert standing.doubt(9.0) == why  # the first reason sticks, however long after
    standing.asked()  # a new quorum request: the lighthouse holds the group alive again
    assert standing.doubt(1.5) is None


def test_a_stall_just_below_the_limit_is_not_doubted() -> None:
    standing = Standing(limit_s=1.0, now=0.0)
    standing.asked()
    assert standing.tick(0.999) is None
    assert standing.doubt(1.5) is None


def test_a_stall_still_open_is_doubted_before_the_loop_has_run_again() -> None:
    # A woken process votes from its training thread before its loop has run.
    standing = Standing(limit_s=1.0, now=0.0)
    standing.tick(0.5)
    standing.asked()
    assert standing.doubt(1.2) is None
    why = standing.doubt(1.6)
    assert why is not None and "1.10s" in why
    # Once the loop ticks, the same stall is remembered until the next request.
    assert standing.tick(1.7) == pytest.approx(1.2)
    assert standing.doubt(1.75) is not None


def test_a_stall_that_ended_before_the_request_is_forgiven() -> None:
    standing = Standing(limit_s=1.0, now=0.0)
    assert standing.tick(3.0) == 3.0
    standing.asked()
    assert standing.doubt(3.1) is None


def test_the_lighthouse_dropping_the_group_is_doubted_until_the_next_request() -> None:
    standing = Standing(limit_s=1.0, now=0.0)
    standing.asked()
    standing.received()
    assert standing.lost(7, "heartbeat expired")
    why = standing.doubt(0.1)
    assert why is not None and "from quorum 7 (heartbeat expired)" in why
    standing.asked()
    assert standing.doubt(0.2) is None


def test_the_limit_may_change_and_must_stay_positive() -> None:
    standing = Standing(limit_s=2.5, now=0.0)
    standing.asked()
    assert standing.doubt(1.5) is None
    standing.limit_s = 1.0  # the lighthouse's welcome says its own timeout
    assert standing.doubt(1.5) is not None
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="limit_s must be > 0"):
            standing.limit_s = bad
    with pytest.raises(ValueError, match="limit_s must be > 0"):
        Standing(limit_s=0.0, now=0.0)


def test_a_notice_that_crossed_the_next_request_is_not_doubted() -> None:
    # Told after its next Welcome that it was dropped from quorum 7 (it had no session then),
    # the group has asked for a newer quorum already: its vote on quorum 7's step was cast
    # before the request, and the lighthouse answers that request only with the group alive.
    standing = Standing(limit_s=1.0, now=0.0)
    standing.asked()
    standing.received()  # quorum 7
    standing.asked()  # the next step's request, not answered yet
    assert not standing.lost(7, "heartbeat expired")
    assert standing.doubt(0.1) is None
    standing.received()  # quorum 8
    assert standing.lost(8, "heartbeat expired")
    assert standing.doubt(0.2) is not None
