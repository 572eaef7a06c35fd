"""The data plan (pure): the order, the shares, and exactly-once over failed attempts."""

from __future__ import annotations

import ast
import random
from fractions import Fraction
from pathlib import Path

import pytest

from torchheal.data import DataPlan, Order, StepKey, next_key, share, step_indices

DATA = Path(__file__).resolve().parents[2] / "torchheal" / "data"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 1000, 1025])
def test_every_epoch_is_a_permutation(size: int) -> None:
    order = Order(size, seed=7)
    for epoch in range(3):
        assert sorted(order.indices(epoch * size, (epoch + 1) * size)) == list(range(size))


def test_order_is_deterministic_seeded_and_shuffled() -> None:
    a, b, c = Order(1000, seed=1), Order(1000, seed=1), Order(1000, seed=2)
    assert a.indices(0, 2000) == b.indices(0, 2000)
    assert a.indices(0, 1000) != c.indices(0, 1000)
    assert a.indices(0, 1000) != a.indices(1000, 2000)  # each epoch its own order
    assert a.indices(0, 1000) != tuple(range(1000))
    assert Order(10, shuffle=False).indices(0, 20) == tuple(range(10)) * 2


def reduced_gradient(shares: list[list[tuple[float, tuple[int, ...]]]]) -> dict[int, Fraction]:
    """What the job applies when sample ``i``'s loss has gradient ``e_i``: each rank's summed
    gradients times its scale, averaged over its group's ranks, then over the groups."""
    total: dict[int, Fraction] = {}
    k = len(shares)
    for group in shares:
        w = len(group)
        for scale, indices in group:
            for i in indices:
                exact = Fraction(scale).limit_denominator(1 << 20)  # the float of k * W / B
                total[i] = total.get(i, Fraction(0)) + exact / w / k
    return total


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_constant_batch_shares_tile_the_step_and_average_b_samples(k: int, ranks: int) -> None:
    plan = DataPlan(dataset_size=500, batch_size=48, micro_batch=5, seed=3)
    key_of = lambda r: StepKey(step=4, participants=k, rank=r)  # noqa: E731
    shares = [[share(plan, key_of(r), w, ranks) for w in range(ranks)] for r in range(k)]
    read = [i for group in shares for s in group for i in s.indices]
    assert read == list(step_indices(plan, key_of(0)))  # in stream order, each once
    assert len(read) == 48 and shares[0][0].start == 4 * 48
    for group in shares:
        # Every rank of a group runs as many micro-batches (FSDP's collectives), none empty.
        assert len({len(s.micro_batches) for s in group}) == 1
        for s in group:
            assert all(0 < len(mb) <= 5 for mb in s.micro_batches)
            assert tuple(i for mb in s.micro_batches for i in mb) == s.indices
    grad = reduced_gradient([[(s.loss_scale, s.indices) for s in g] for g in shares])
    # The step's gradient: every one of its B samples weighted 1/B, whoever read it.
    assert grad == {i: Fraction(1, 48) for i in read}


def test_a_group_that_does_not_contribute_reads_a_filler_that_counts_nothing() -> None:
    plan = DataPlan(dataset_size=100, batch_size=8)
    s = share(plan, StepKey(step=2, participants=2, rank=None))
    assert s.filler and s.indices == () and s.loss_scale == 0.0
    assert len(s.micro_batches) == 1 and len(s.micro_batches[0]) == 1
    # A rank of a contributing group can get nothing too (fewer samples than ranks).
    tiny = share(DataPlan(dataset_size=100, batch_size=2), StepKey(0, 2, 1), 0, 2)
    assert tiny.filler and tiny.loss_scale == 0.0


def test_per_group_batch_follows_the_committed_batches() -> None:
    plan = DataPlan(dataset_size=1000, batch_size=4, constant_global_batch=False)
    # Two steps of 3 groups and one of 2 were committed: 8 group-batches, 32 samples.
    s = share(plan, StepKey(step=3, participants=2, rank=1, batches_committed=8))
    assert (s.start, s.size, s.lo, s.hi, s.loss_scale) == (32, 8, 36, 40, 0.25)


def test_inner_steps_of_a_window_follow_each_other() -> None:
    plan = DataPlan(dataset_size=1000, batch_size=6, inner_steps=4)
    key = StepKey(step=2, participants=3, rank=0)
    starts = []
    for _ in range(6):
        starts.append((key.step, key.inner, share(plan, key).start))
        key = next_key(plan, key)
    assert starts == [(2, 0, 48), (2, 1, 54), (2, 2, 60), (2, 3, 66), (3, 0, 72), (3, 1, 78)]


def test_bad_plans_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        DataPlan(dataset_size=10, batch_size=0)
    with pytest.raises(ValueError, match="micro_batch"):
        DataPlan(dataset_size=10, batch_size=2, micro_batch=1)
    with pytest.raises(ValueError, match="group_rank 2"):
        share(DataPlan(dataset_size=10, batch_size=2), StepKey(0, 1, 0), 2, 2)


def run_job(plan: DataPlan, attempts: list[tuple[list[int], bool]]) -> list[tuple[int, ...]]:
    """Samples of each committed step, groups ordered by rank, as a real job would see them.

    ``attempts``: per attempt, the groups in its quorum and whether it committed. Each group
    keeps only what the Manager gives it: the step and batches_committed (carried by heals)."""
    step = committed_batches = 0
    history = []
    for groups, ok in attempts:
        k = len(groups)
        keys = [StepKey(step, k, r, 0, committed_batches) for r in range(k)]
        read = tuple(i for key in keys for i in share(plan, key).indices)
        if ok:
            history.append(read)
            step += 1
            committed_batches += k
    return history


@pytest.mark.parametrize("constant", [True, False])
def test_failed_attempts_and_changing_quorums_read_every_sample_once(constant: bool) -> None:
    plan = DataPlan(dataset_size=10_000, batch_size=12, constant_global_batch=constant, seed=5)
    rng = random.Random(0)
    quorums = [[0, 1, 2], [0, 2], [1], [0, 1], [2, 1, 0]]
    attempts = [(rng.choice(quorums), rng.random() > 0.3) for _ in range(200)]
    history = run_job(plan, attempts)
    flat = [i for step in history for i in step]
    assert len(flat) == len(set(flat)), "a sample was read twice across committed steps"
    # The same stream as a run where nothing fails: only the split per step may differ.
    assert flat == list(Order(10_000, seed=5).indices(0, len(flat)))
    if constant:
        free = run_job(plan, [([0, 1, 2], True)] * len(history))
        assert history == free  # step for step, the failure-free run's samples


@pytest.mark.parametrize("module", ["plan.py", "order.py"])
def test_the_plan_is_pure(module: str) -> None:
    tree = ast.parse((DATA / module).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert imported <= {"__future__", "collections", "dataclasses", "torchheal"}, imported
