"""The lighthouse's etcd store (``lighthouse_etcd``) against a real etcd on loopback.

One leader at a time; a standby takes over when the leader's lease lapses and starts from the
leader's record; a deposed leader can never write again, and is told it lost.
"""

from __future__ import annotations

import threading
from pathlib import Path

from tests.coordination_io.helpers import Background, wait_until
from tests.lighthouse_restart.etcd import etcd_server
from torchheal.coordination.lighthouse_etcd import EtcdLeaderStore
from torchheal.coordination.lighthouse_state import StoreError
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
