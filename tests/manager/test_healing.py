"""Two replica groups on threads: live healing, participation and spares."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from tests.cluster import Replica, lighthouse, replica, run_parallel
from torchheal.manager import WorldSizeMode
from torchheal.process_group.gloo import ProcessGroupGloo

pytestmark = pytest.mark.timeout(60)


def _step(r: Replica, grad: float, **quorum_kwargs: object) -> dict[str, object]:
    """One training step on the calling thread; returns what the test checks."""
    m = r.manager
    m.start_quorum(**quorum_kwargs)  # type: ignore[arg-type]
    weight_after_quorum = r.weight.clone()
    g = torch.full((3,), grad)
    m.allreduce(g).wait()
    participants = m.num_participants()
    participating = m.is_participating()
    committed = m.should_commit()
    return {
        "thread": threading.get_ident(),
        "grad": g,
        "participants": participants,
        "participating": participating,
        "committed": committed,
        "weight_after_quorum": weight_after_quorum,
    }


def test_sync_heal_loads_on_the_training_thread() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, use_async_quorum=False) as a,
        replica(lh, "b", weight=0.0, use_async_quorum=False) as b,
    ):
        a.manager.load_state_dict({"step": 20, "batches_committed": 40})
        res_a, res_b = run_parallel(lambda: _step(a, 1.0), lambda: _step(b, 5.0))
        assert a.loads == []
        assert b.loads == [res_b["thread"]]  # once, on b's training thread
        assert a.reads == {res_a["thread"]}  # the sender read its state on its own thread
        # Healed before the forward pass: the weights were already there after start_quorum.
        assert torch.equal(res_b["weight_after_quorum"], torch.full((3,), 3.0))
        # Synchronous healing: both replicas contribute.
        for res in (res_a, res_b):
            assert res["participants"] == 2 and res["participating"] and res["committed"]
            assert torch.equal(res["grad"], torch.full((3,), 3.0))  # (1 + 5) / 2
        assert a.manager.current_step() == b.manager.current_step() == 21
        assert b.manager.batches_committed() == 42


@pytest.mark.parametrize("init_sync", [True, False])
def test_init_sync_decides_whether_step_0_transfers_state(init_sync: bool) -> None:
    # Two groups at step 0 with different weights. With init_sync one heals from the other;
    # without it nothing moves at all: no load, no heal, and no state read for a peer. (The
    # divergence guard would report the difference: tests/manager/test_divergence_threads.py.)
    off = {"divergence_check_interval": 0}
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, use_async_quorum=False, init_sync=init_sync, **off) as a,
        replica(lh, "b", weight=0.0, use_async_quorum=False, init_sync=init_sync, **off) as b,
    ):
        results = run_parallel(lambda: _step(a, 1.0), lambda: _step(b, 1.0))
        assert all(res["committed"] for res in results)
        healed = [r.name for r in (a, b) if r.loads]
        if init_sync:
            assert len(healed) == 1
            assert torch.equal(a.weight, b.weight)
        else:
            assert healed == []
            assert a.manager._pending_state_dict is None and b.manager._pending_state_dict is None
            assert torch.equal(a.weight, torch.full((3,), 3.0))
            assert torch.equal(b.weight, torch.zeros(3))
        assert a.manager.current_step() == b.manager.current_step() == 1


def test_async_heal_zero_grad_commit() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0) as a,
        replica(lh, "b", weight=0.0) as b,
    ):
        a.manager.load_state_dict({"step": 20, "batches_committed": 0})
        res_a, res_b = run_parallel(lambda: _step(a, 2.0), lambda: _step(b, 5.0))
        # The healer contributed zeros and only the up-to-date replica counts.
        for res in (res_a, res_b):
            assert res["participants"] == 1 and res["committed"]
            assert torch.equal(res["grad"], torch.full((3,), 2.0))
        assert res_b["participating"] is False and res_a["participating"] is True
        assert b.loads == [res_b["thread"]]  # loaded in should_commit, same thread
        assert torch.equal(b.weight, torch.full((3,), 3.0))
        assert a.manager.current_step() == b.manager.current_step() == 21
        assert a.manager.batches_committed() == b.manager.batches_committed() == 1
        # The next step: both up to date, both contribute.
        res_a, res_b = run_parallel(lambda: _step(a, 2.0), lambda: _step(b, 4.0))
        for res in (res_a, res_b):
            assert res["participants"] == 2 and res["committed"]
            assert torch.equal(res["grad"], torch.full((3,), 3.0))
        assert len(b.loads) == 1  # no second heal


def test_async_heal_with_too_few_participants_does_not_commit() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, min_replica_size=2) as a,
        replica(lh, "b", weight=0.0, min_replica_size=2) as b,
    ):
        a.manager.load_state_dict({"step": 20, "batches_committed": 0})
        res_a, res_b = run_parallel(lambda: _step(a, 2.0), lambda: _step(b, 5.0))
        assert not res_a["committed"] and not res_b["committed"]
        assert torch.equal(res_b["grad"], torch.full((3,), 2.0))  # own gradient zeroed
        assert len(b.loads) == 1 and torch.equal(b.weight, torch.full((3,), 3.0))
        assert b.manager.current_step() == 20  # healed, not committed
        assert b.manager.batches_committed() == 0


def test_allow_heal_false() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0) as a,
        replica(lh, "b", weight=0.0) as b,
    ):
        a.manager.load_state_dict({"step": 5, "batches_committed": 0})
        res_a, res_b = run_parallel(
            lambda: _step(a, 2.0, allow_heal=False), lambda: _step(b, 5.0, allow_heal=False)
        )
        assert b.loads == [] and torch.equal(b.weight, torch.zeros(3))
        assert res_b["participating"] is False and res_a["participating"] is True
        assert res_a["committed"] and res_b["committed"]
        assert torch.equal(res_b["grad"], torch.full((3,), 2.0))
        assert b.manager.current_step() == 1 and a.manager.current_step() == 6


def test_fixed_with_spares() -> None:
    kwargs = dict(world_size_mode=WorldSizeMode.FIXED_WITH_SPARES, init_sync=False)
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", **kwargs) as a,
        replica(lh, "b", **kwargs) as b,
    ):
        res_a, res_b = run_parallel(lambda: _step(a, 2.0), lambda: _step(b, 5.0))
        # Sorted replica ids: "a:..." is rank 0 (participant), "b:..." rank 1 (spare).
        assert a.manager.participating_rank() == 0
        assert b.manager.participating_rank() is None
        for res in (res_a, res_b):
            assert res["participants"] == 1 and res["committed"]
            assert torch.equal(res["grad"], torch.full((3,), 2.0))  # spare sent zeros


def test_failed_load_heals_again_next_step() -> None:
    # b skips its collectives once errored, so a's allreduce waits out its timeout: keep it short.
    short = dict(use_async_quorum=False, timeout=timedelta(seconds=1))
    with (
        lighthouse(min_replicas=2) as lh,
        replica(
            lh, "a", weight=3.0, pg=ProcessGroupGloo(timeout=timedelta(seconds=1)), **short
        ) as a,
        replica(
            lh, "b", weight=0.0, pg=ProcessGroupGloo(timeout=timedelta(seconds=1)), **short
        ) as b,
    ):
        a.manager.load_state_dict({"step": 7, "batches_committed": 0})
        b.fail_loads = 1
        res_a, res_b = run_parallel(lambda: _step(a, 1.0), lambda: _step(b, 1.0))
        assert not res_a["committed"] and not res_b["committed"]
        assert "load_state_dict failed" in str(b.manager.errored())
        assert b.manager.current_step() == 0  # not healed: reports its old step again
        res_a, res_b = run_parallel(lambda: _step(a, 1.0), lambda: _step(b, 1.0))
        assert res_a["committed"] and res_b["committed"]
        assert len(b.loads) == 2 and torch.equal(b.weight, torch.full((3,), 3.0))
        assert a.manager.current_step() == b.manager.current_step() == 8
