"""The divergence guard inside the Manager, with replica groups on threads (fast cases).

Two or three one-rank groups against an in-process lighthouse (``tests/cluster.py``), a
weight vector of three floats as the user state. The process tests in ``tests/divergence/``
cover the issue's cases with real processes; these pin the Manager's side: a group that
differs votes no and heals from the reference at the next quorum, ``warn`` only reports,
``stop`` raises after the vote, and groups with other settings run no comparison at all.
"""

from __future__ import annotations

import pytest
import torch

from tests.cluster import Replica, lighthouse, replica, run_parallel
from torchheal.manager.guard import DivergenceError

pytestmark = pytest.mark.timeout(60)


def _step(r: Replica) -> bool:
    m = r.manager
    m.start_quorum()
    m.allreduce(torch.zeros(3)).wait()
    return m.should_commit()


def _stats(r: Replica) -> tuple[int, int, int]:
    s = r.manager._telemetry.stats
    return s.divergence_checks, s.divergence_mismatches, s.last_verified_step


def test_groups_seeded_differently_are_found_and_repaired() -> None:
    # init_sync=False promises identical seeds; these differ. Step 0 is not compared (a step
    # where replicas may heal); step 1's handshake finds it; b (the higher rank: neither
    # healed) votes no, heals from a at step 2, and step 3 (after the heal) matches.
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, init_sync=False, divergence_check_interval=1) as a,
        replica(lh, "b", weight=0.0, init_sync=False, divergence_check_interval=1) as b,
    ):
        assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, True]
        assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, False]
        assert _stats(a)[1] == _stats(b)[1] == 1
        assert a.manager.current_step() == 2 and b.manager.current_step() == 1
        assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, True]
        assert torch.equal(b.weight, torch.full((3,), 3.0))  # healed from a
        assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, True]
        assert _stats(b)[1:] == (1, 3)  # the step after the heal was compared, and matched
        assert a.manager.current_step() == b.manager.current_step() == 4


def test_warn_only_reports() -> None:
    kwargs = dict(init_sync=False, divergence_check_interval=1, on_divergence="warn")
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, **kwargs) as a,
        replica(lh, "b", weight=0.0, **kwargs) as b,
    ):
        for _ in range(2):  # step 0 is not compared, step 1 is
            assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, True]
        assert _stats(a)[:2] == _stats(b)[:2] == (1, 1)
        assert not torch.equal(a.weight, b.weight)


def test_stop_raises_on_every_group_after_its_vote() -> None:
    kwargs = dict(init_sync=False, divergence_check_interval=1, on_divergence="stop")
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, **kwargs) as a,
        replica(lh, "b", weight=0.0, **kwargs) as b,
    ):

        def step(r: Replica) -> str:
            try:
                _step(r)
            except DivergenceError as e:
                return str(e)
            return "no error"

        assert run_parallel(lambda: step(a), lambda: step(b)) == ["no error"] * 2  # step 0
        for message in run_parallel(lambda: step(a), lambda: step(b)):
            assert message.startswith("divergence at step 1"), message
        assert a.manager.current_step() == b.manager.current_step() == 1  # nobody committed


def test_groups_with_other_settings_compare_nothing() -> None:
    # a checks every step, b every 2: the handshake disarms it, nothing hangs and the
    # difference goes unreported (every group must pass the same settings).
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, init_sync=False, divergence_check_interval=1) as a,
        replica(lh, "b", weight=0.0, init_sync=False, divergence_check_interval=2) as b,
    ):
        for _ in range(3):
            assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, True]
        assert _stats(a) == _stats(b) == (0, 0, -1)


def test_interval_counts_committed_steps() -> None:
    # Identical groups, interval 2: the handshake at step 1 (step 0 may heal) and steps 2 and
    # 4 are compared.
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=1.0, divergence_check_interval=2) as a,
        replica(lh, "b", weight=1.0, divergence_check_interval=2) as b,
    ):
        for _ in range(5):
            assert run_parallel(lambda: _step(a), lambda: _step(b)) == [True, True]
        assert _stats(a) == _stats(b) == (3, 0, 4)
