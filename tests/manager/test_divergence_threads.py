"""The divergence guard inside the Manager, with replica groups on threads (fast cases).

Two or three one-rank groups against an in-process lighthouse (``tests/cluster.py``), a
weight vector of three floats as the user state. The process tests in ``tests/divergence/``
cover the issue's cases with real processes; these pin the Manager's side: a group that
differs votes no and heals from the reference at the next quorum, ``warn`` only reports,
``stop`` raises after the vote, the guard is on by default, and a job where one group has the
guard off or other settings trains normally with no comparison at all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.cluster import Replica, lighthouse, replica, run_parallel, train_step
from torchheal.manager.guard import DivergenceError

pytestmark = pytest.mark.timeout(60)


def _stats(r: Replica) -> tuple[int, int, int]:
    s = r.manager._telemetry.stats
    return s.divergence_checks, s.divergence_mismatches, s.last_verified_step


def test_groups_seeded_differently_are_found_and_repaired() -> None:
    # init_sync=False promises identical seeds; these differ. Step 0 is not compared (a step
    # where replicas may heal); step 1 (the quorum's first without a heal) is, and its verdict
    # is taken at step 2's vote: b (the higher rank: neither healed) votes no there, heals from
    # a at step 3 (step 2's verdict, the same, asks nothing of it then: it healed since), and
    # step 4 (after the heal) matches, as step 5 says.
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, init_sync=False, divergence_check_interval=1) as a,
        replica(lh, "b", weight=0.0, init_sync=False, divergence_check_interval=1) as b,
    ):
        for _ in range(2):
            assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
        assert _stats(a)[:2] == _stats(b)[:2] == (0, 0)  # step 1's verdict is still on its way
        assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, False]
        assert _stats(a)[1] == _stats(b)[1] == 1
        assert a.manager.current_step() == 3 and b.manager.current_step() == 2
        assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
        assert torch.equal(b.weight, torch.full((3,), 3.0))  # healed from a
        for _ in range(2):
            assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
        assert _stats(b)[2] == 4  # the step after the heal was compared, and matched
        assert a.manager.current_step() == b.manager.current_step() == 6


def test_warn_only_reports() -> None:
    kwargs = dict(init_sync=False, divergence_check_interval=1, on_divergence="warn")
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, **kwargs) as a,
        replica(lh, "b", weight=0.0, **kwargs) as b,
    ):
        for _ in range(3):  # step 0 is not compared, step 1 is (its verdict comes at step 2)
            assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
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
                train_step(r)
            except DivergenceError as e:
                return str(e)
            return "no error"

        for _ in range(2):  # step 0 is not compared; step 1's verdict comes at step 2's vote
            assert run_parallel(lambda: step(a), lambda: step(b)) == ["no error"] * 2
        for message in run_parallel(lambda: step(a), lambda: step(b)):
            assert message.startswith("divergence at step 1"), message
        assert a.manager.current_step() == b.manager.current_step() == 2  # nobody committed


@pytest.mark.parametrize(
    "other",
    [
        {"divergence_check_interval": 0},  # the guard off
        {"divergence_check_interval": 2},  # another interval
        {"divergence_check_interval": 1, "on_divergence": "warn"},  # another policy
    ],
    ids=["off", "interval", "policy"],
)
def test_a_group_with_other_settings_trains_normally_without_comparison(
    other: dict[str, Any],
) -> None:
    # a checks every step; b does not, or with other settings. Their replica ids say so, so
    # neither runs an exchange (a's would pair with b's next collective): both commit every
    # step, and the difference goes unreported (every group must pass the same settings).
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, init_sync=False, divergence_check_interval=1) as a,
        replica(lh, "b", weight=0.0, init_sync=False, **other) as b,
    ):
        for _ in range(4):
            assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
        assert _stats(a) == _stats(b) == (0, 0, -1)
        assert a.manager.current_step() == b.manager.current_step() == 4
        assert a.weight[0].item() == 3.0 and b.weight[0].item() == 0.0


def test_the_guard_is_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # No argument, no variable: every 100 steps and at each new quorum's first step without a
    # heal (step 1 here), under repair.
    monkeypatch.delenv("TORCHHEAL_DIVERGENCE_CHECK_INTERVAL", raising=False)
    monkeypatch.delenv("TORCHHEAL_ON_DIVERGENCE", raising=False)
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0, init_sync=False) as a,
        replica(lh, "b", weight=0.0, init_sync=False) as b,
    ):
        for _ in range(2):
            assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
        assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [
            True,
            False,
        ]  # b repairs
        assert _stats(a)[:2] == _stats(b)[:2] == (1, 1)
        assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
        assert torch.equal(b.weight, torch.full((3,), 3.0))  # healed from a


def test_interval_counts_committed_steps() -> None:
    # Identical groups, interval 2: the quorum's first step without a heal (step 1: step 0
    # may heal) and steps 2 and 4 are compared (step 4's verdict taken at step 5).
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=1.0, divergence_check_interval=2) as a,
        replica(lh, "b", weight=1.0, divergence_check_interval=2) as b,
    ):
        for _ in range(6):
            assert run_parallel(lambda: train_step(a), lambda: train_step(b)) == [True, True]
        assert _stats(a) == _stats(b) == (3, 0, 4)
