"""The lighthouse's etcd store (``lighthouse_etcd``) against a real etcd on loopback.

One leader at a time; a standby takes over when the leader's lease lapses and starts from the
leader's record; a deposed leader can never write again, and is told it lost. A standby rides out
an etcd outage (etcd SIGKILLed and started again) and still takes over afterwards.
"""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

import pytest

from tests.coordination_io.helpers import Background, wait_until
from tests.lighthouse_restart.etcd import etcd_process, etcd_server
from torchheal.coordination.lighthouse.etcd import (
    OUTAGE_BACKOFF_MAX_S,
    OUTAGE_REMIND_S,
    STANDBY_POLL_S,
    EtcdLeaderStore,
    Outage,
)
from torchheal.coordination.lighthouse.store import StoreError
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp


def _quorum(quorum_id: int) -> Quorum:
    member = QuorumMember(replica_id="g0", address="http://g0:1", store_address="g0:2")
    return Quorum(quorum_id=quorum_id, participants=(member,), created=Timestamp(1, 0))


def test_standby_takes_over_from_the_record_and_the_old_leader_cannot_write(
    tmp_path: Path,
) -> None:
    with etcd_server(tmp_path) as url:
        lost: list[str] = []
        stop = threading.Event()
        first = EtcdLeaderStore(url, "/t/job", 1, on_lost=lambda: lost.append("first"))
        second = EtcdLeaderStore(url, "/t/job", 1, on_lost=lambda: lost.append("second"))
        try:
            assert first.acquire(stop)
            assert first.load() is None
            first.save(_quorum(5))
            standby = Background(lambda: second.acquire(stop))
            # The standby keeps waiting while the leader renews its lease (several lease times).
            wait_until(lambda: second.attempts >= 8, what="the standby's attempts")
            assert standby.result is None and not lost
            first.pause()  # the leader stops renewing, as a SIGKILLed or frozen one would
            assert standby.join(timeout=30) is True
            assert second.load().quorum_id == 5  # type: ignore[union-attr]
            second.save(_quorum(6))
            try:
                first.save(_quorum(6))
                raise AssertionError("a deposed leader saved a quorum")
            except StoreError as e:
                assert "no longer leads" in str(e)
            assert lost == ["first"]
            assert second.load().quorum_id == 6  # type: ignore[union-attr]
        finally:
            stop.set()
            first.close()
            second.close()


def test_an_outage_that_never_ends_backs_off_to_a_bound_and_is_logged_rarely() -> None:
    outage = Outage()
    assert outage.answered(0.0) is None  # etcd answers: nothing to report
    now, waits, said = 100.0, [], []
    while now < 100.0 + 10 * OUTAGE_REMIND_S:
        wait, say = outage.failed(now)
        waits.append(wait)
        if say:
            said.append(now)
        now += wait
    assert waits[:4] == [STANDBY_POLL_S * 2**i for i in range(4)]
    assert max(waits) == waits[-1] == OUTAGE_BACKOFF_MAX_S
    # Said when it starts, then once a minute or so: not once per poll.
    assert said[0] == 100.0 and 10 <= len(said) <= 11
    assert all(
        OUTAGE_REMIND_S <= b - a <= OUTAGE_REMIND_S + OUTAGE_BACKOFF_MAX_S
        for a, b in itertools.pairwise(said)
    )
    assert outage.answered(now) == (now - 100.0, len(waits))
    # The next outage starts over: said at once, polled again soon.
    assert outage.failed(now) == (STANDBY_POLL_S, True)


# Longer than the outage below (etcd's restart included): the leader rides it out too.
OUTAGE_LEASE_S = 10


def _outage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("etcd outage")]


def _still_standing_by(store: EtcdLeaderStore, standby: Background, polls: int, what: str) -> None:
    """Wait for ``polls`` more elections by ``store``; its ``acquire`` must still be waiting."""
    start = store.attempts
    wait_until(lambda: standby.error is not None or store.attempts >= start + polls, 20, what)
    assert standby.error is None and standby.result is None, f"{what}: {standby.error!r}"


def test_a_standby_rides_out_an_etcd_outage_and_takes_over_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="torchheal.coordination.lighthouse.etcd")
    with etcd_process(tmp_path) as etcd:
        lost: list[str] = []
        stop = threading.Event()
        leader = EtcdLeaderStore(etcd.url, "/t/job", OUTAGE_LEASE_S, lambda: lost.append("l"))
        second = EtcdLeaderStore(etcd.url, "/t/job", OUTAGE_LEASE_S, lambda: lost.append("s"))
        try:
            assert leader.acquire(stop)
            leader.save(_quorum(5))
            standby = Background(lambda: second.acquire(stop))
            _still_standing_by(second, standby, 2, "the standby's first polls")

            etcd.stop()  # an outage: every poll fails, fast (connection refused)
            _still_standing_by(second, standby, 4, "polls failing in the outage")
            etcd.start()
            wait_until(lambda: len(_outage_lines(caplog)) >= 2, 20, "the outage's end logged")
            # Still standing by once etcd is back: the leader renews its lease.
            _still_standing_by(second, standby, 4, "polls after the outage")
            assert not lost

            leader.pause()  # the leader dies later: the standby takes over from its record
            assert standby.join(timeout=OUTAGE_LEASE_S + 20) is True
            assert second.load().quorum_id == 5  # type: ignore[union-attr]
            lines = _outage_lines(caplog)
            # One line when the outage starts and one when it ends, not one per failed poll.
            assert len(lines) == 2, lines
            assert "standing by" in lines[0] and "over after" in lines[1], lines
        finally:
            stop.set()
            leader.close()
            second.close()
