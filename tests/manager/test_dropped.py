"""A group the lighthouse dropped stops waiting in its collectives of that quorum at once.

A group frozen past its heartbeat timeout (SIGSTOP, a stalled host) is dropped; its peers redo
the step without it. Woken, it may be blocked in a collective of that quorum whose peers have
left: Gloo does not always wake a receive when the peer's connection closes (stop 37 of issue 9:
3 of 45 runs of a real-process test, and cutting our own end does not end it either), so the
collective waited out its timeout (60 s) before the group healed. When the lighthouse's notice
says so, the Manager now ends what is pending in that quorum and aborts the group.

The collectives here never complete on their own (``PendingGroup``: the state of a woken Gloo
receive that nothing wakes), so only the notice can end them. The notice is delivered as the
manager server delivers it (``_on_notice``, the listener it calls for each notice); its
way from the lighthouse is covered by ``tests/coordination_io/test_session.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.cluster import lighthouse, replica
from tests.manager.twins import PendingGroup
from torchheal.coordination.types import Notice, NoticeKind
from torchheal.manager.failfast import DroppedError

pytestmark = pytest.mark.timeout(60)

#: Far below the Manager's timeout in these tests (60 s): a collective ended by the notice.
ENDED_WITHIN_S = 5.0


def _lands_and_commits(m, pg: PendingGroup, fut, value: float) -> None:  # type: ignore[no-untyped-def]
    """The pending collective lands: its step commits with what it reduced."""
    future, tensors = pg.issued[-1]
    future.set_result(tensors)
    torch.testing.assert_close(fut.wait(), torch.full((2,), value))
    assert m.should_commit() is True


def _notice(m, quorum_id: int, reason: str = "heartbeat expired", superseded: bool = False):  # type: ignore[no-untyped-def]
    """What the manager server calls when the lighthouse says this group was dropped."""
    kind = NoticeKind.SUPERSEDED if superseded else NoticeKind.DROPPED
    m._on_notice(Notice(kind, m._full_replica_id, quorum_id, reason))


@contextmanager
def _one_group() -> Iterator[tuple[Any, PendingGroup]]:
    """A group alone in its first quorum, its collectives on a ``PendingGroup``."""
    pg = PendingGroup()
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        r.manager.start_quorum()
        r.manager.wait_quorum()
        yield r.manager, pg


def test_a_dropped_group_ends_its_pending_collectives_and_fails_the_step_at_once() -> None:
    with _one_group() as (m, pg):
        quorum_id = m._connected.quorum_id
        bucket = torch.full((4,), 3.0)
        hooked = m.allreduce(bucket).as_future()  # DDP's comm hook path
        waited = m.allreduce(torch.ones(2))  # a loop that waits on the work itself
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(waited.wait()), daemon=True)
        waiter.start()
        assert not hooked.done()

        started = time.monotonic()
        _notice(m, quorum_id)
        assert hooked.wait() is bucket  # the bucket as it was: the step is discarded
        waiter.join(ENDED_WITHIN_S)
        assert not waiter.is_alive(), "work.wait() still waits on a collective of its quorum"
        assert time.monotonic() - started < ENDED_WITHIN_S
        assert outcome == [False]
        error = m.errored()
        assert error is not None and isinstance(error.original_exception, DroppedError)
        assert f"dropped from quorum {quorum_id} (heartbeat expired)" in str(error)
        assert m._connected.quorum_id == -1  # the next quorum rebuilds the group
        assert m.should_commit() is False

        # The next quorum's group is adopted and trains as usual.
        m.start_quorum()
        m.wait_quorum()
        assert m._connected.quorum_id > 0 and m._connected.expiry.expired is None
        _lands_and_commits(m, pg, m.allreduce(torch.full((2,), 5.0)).as_future(), 5.0)


@contextmanager
def _two_groups(**manager_kwargs: Any) -> Iterator[tuple[Any, PendingGroup]]:
    """Group a in its first quorum with b (an average divides by 2), on a ``PendingGroup``."""
    pg = PendingGroup()
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", pg=pg, **manager_kwargs) as r,
        replica(lh, "b", pg=PendingGroup(), **manager_kwargs) as peer,
    ):
        for manager in (r.manager, peer.manager):
            manager.start_quorum()
        for manager in (r.manager, peer.manager):
            manager.wait_quorum()
        assert r.manager.num_participants() == 2
        yield r.manager, pg


def test_a_late_completion_after_the_drop_changes_nothing() -> None:
    # The collective that completes after the drop ended it is too late: the average (a
    # division by the 2 participants) is not applied to what the loop already has.
    with _two_groups() as (m, pg):
        bucket = torch.full((4,), 3.0)
        fut = m.allreduce(bucket).as_future()
        _notice(m, m._connected.quorum_id)
        assert fut.wait() is bucket
        for future, tensors in pg.issued:
            future.set_result(tensors)
        torch.testing.assert_close(bucket, torch.full((4,), 3.0))
        assert m.should_commit() is False


def test_a_dropped_group_does_not_salvage_its_step(caplog: pytest.LogCaptureFixture) -> None:
    # Its peers redid the step without it: it heals instead of redoing the step, even though
    # its collectives were ended by an abort (which a salvage would otherwise redo).
    with _two_groups(salvage_step=True) as (m, _pg):
        m.allreduce(torch.full((2,), 1.0))
        _notice(m, m._connected.quorum_id)
        with caplog.at_level("INFO", logger="torchheal.manager"):
            assert m.should_commit() is False
        assert "this group was dropped from the quorum" in caplog.text
        assert "salvaging step" not in caplog.text


def test_a_group_only_left_out_of_a_newer_quorum_keeps_its_collectives() -> None:
    # Superseded: its peers completed the step with it before they moved on, so its collective
    # completes too and the step commits as theirs did; nothing is ended or aborted.
    with _one_group() as (m, pg):
        quorum_id = m._connected.quorum_id
        fut = m.allreduce(torch.full((2,), 7.0)).as_future()
        _notice(m, quorum_id, f"not in quorum {quorum_id + 1}", superseded=True)
        _notice(m, quorum_id - 1)  # a drop from an older quorum: not the group in use
        assert not fut.done() and m.errored() is None
        assert m._connected.quorum_id == quorum_id
        _lands_and_commits(m, pg, fut, 7.0)


def test_a_lost_peer_ends_collectives_its_abort_did_not_wake() -> None:
    # The survivors' side: the cut of the aborted group wakes a blocked Gloo collective, but a
    # collective that is not woken (PendingGroup) ends with the abort all the same.
    pg = PendingGroup()
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", pg=pg) as r,
        replica(lh, "b", pg=PendingGroup()) as peer,
    ):
        m = r.manager
        for manager in (m, peer.manager):
            manager.start_quorum()
        for manager in (m, peer.manager):
            manager.wait_quorum()
        quorum_id = m._connected.quorum_id
        lost = peer.manager._full_replica_id
        assert lost in m._connected.members
        bucket = torch.full((3,), 2.0)
        fut = m.allreduce(bucket).as_future()
        m._on_notice(Notice(NoticeKind.LOST, lost, quorum_id, "connection ended"))
        assert fut.wait() is bucket
        assert f"{lost} of quorum {quorum_id} is lost (connection ended)" in str(m.errored())
        assert not isinstance(m.errored().original_exception, DroppedError)
        assert m.should_commit() is False
