"""A group that commits its last step and leaves does not fail the step its peers are still in.

Its goodbye says how many steps it committed (``Goodbye.steps_done``); a peer still in that step
received all its data, so the lost-member notice keeps the peer's process group instead of
aborting it (``machine.Connection.on_notice``). Before, the peer failed its last step and, with
``min_replicas=1``, redid it alone: the two groups ended the job with different weights.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.cluster import TIMEOUT, Replica, lighthouse, replica, run_parallel
from torchheal import ProcessGroupGloo
from torchheal.process_group.wrappers import ProcessGroupWrapper

pytestmark = pytest.mark.timeout(60)


class _GatedWork(dist.Work):
    """The inner work, seen completed only once ``gate`` is open: a collective whose data has
    all been sent by the peer but that this group has not finished yet (a busy thread)."""

    def __init__(self, work: dist.Work, gate: threading.Event) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        inner = work.get_future()

        def settle() -> None:
            gate.wait()
            try:
                inner.wait()
                self._future.set_result(inner.value())
            except Exception as e:
                self._future.set_exception(e)

        threading.Thread(target=settle, daemon=True).start()

    def wait(self, timeout: object = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class _GatedGloo(ProcessGroupWrapper):
    def __init__(self, gate: threading.Event) -> None:
        super().__init__(pg=ProcessGroupGloo(timeout=TIMEOUT))
        self.gate = gate

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        return _GatedWork(super()._wrap_work(work, opts), self.gate)


def _step(r: Replica) -> bool:
    r.manager.start_quorum()
    r.manager.allreduce(r.weight).wait()
    return r.manager.should_commit()


def _heard_lost(r: Replica) -> threading.Event:
    """Set once the replica's Manager handled a lost-member notice (any action)."""
    heard = threading.Event()
    recovery = r.manager._recovery
    on_member_lost = recovery.on_member_lost

    def observed(*args: object) -> None:
        on_member_lost(*args)
        heard.set()

    recovery.on_member_lost = observed
    return heard


@pytest.mark.parametrize("round_", range(3))
def test_the_peer_of_a_group_that_committed_and_left_commits_the_same_step(round_: int) -> None:
    gate = threading.Event()
    gate.set()
    with (
        lighthouse(min_replicas=1, join_timeout_ms=200) as lh,
        replica(lh, "a", weight=1.0, init_sync=False) as a,
        replica(lh, "b", weight=3.0, init_sync=False, pg=_GatedGloo(gate)) as b,
    ):
        assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, True]
        heard = _heard_lost(b)
        # The last step: a's collective completes, it commits and leaves at once; b's is seen
        # complete, and b votes, only once a's goodbye reached it.
        run_parallel(a.manager.start_quorum, b.manager.start_quorum)
        gate.clear()
        b_work = b.manager.allreduce(b.weight)
        a.manager.allreduce(a.weight).wait()
        assert a.manager.should_commit()
        a.manager.shutdown()
        assert heard.wait(20), "b never heard that a left"
        gate.set()
        b_work.wait()
        assert b.manager.should_commit(), "b failed the step a committed before it left"
        assert a.manager.current_step() == b.manager.current_step() == 2
        assert torch.equal(a.weight, b.weight)
