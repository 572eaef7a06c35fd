"""End-to-end fault-tolerant DDP: real lighthouse, real manager servers, real processes.

Replica groups are separate processes; failures are SIGKILLs; a killed group is restarted and
must heal live and end with exactly the weights of the groups that never failed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import warm
from tests.integration.jobs import GroupPlan, JobSpec, run_job
from tests.integration.workers import failure_free, train_ddp, train_plain_ddp

pytestmark = pytest.mark.slow


def assert_groups_identical(states: dict, groups: list[int], ranks: int = 1) -> None:
    for rank in range(ranks):
        ref = states[(groups[0], rank)]["model"]
        for g in groups[1:]:
            other = states[(g, rank)]["model"]
            for key in ref:
                torch.testing.assert_close(
                    other[key], ref[key], rtol=0, atol=0, msg=f"group {g} rank {rank} {key}"
                )


def assert_failure_free(
    states: dict, groups: list[int], steps: int, ranks: int = 1, async_init_sync: bool = True
) -> None:
    """Every group ends with exactly the weights of a run in which nothing failed."""
    for rank in range(ranks):
        expected = failure_free(steps, rank, len(groups), async_init_sync=async_init_sync)
        for g in groups:
            for key, value in expected.items():
                torch.testing.assert_close(
                    states[(g, rank)]["model"][key], value, rtol=0, atol=0, msg=f"g{g}r{rank} {key}"
                )


def test_healthy_two_groups_end_identical(tmp_path):
    spec = JobSpec(steps=4)
    result = run_job(train_ddp, spec, [GroupPlan(0), GroupPlan(1)], tmp_path)
    assert_groups_identical(result.states, [0, 1])
    assert_failure_free(result.states, [0, 1], steps=4)
    assert result.failures == {0: 0, 1: 0}
    for key in [(0, 0), (1, 0)]:
        assert result.states[key]["step"] == 4
        assert result.states[key]["failed_steps"] == []


@pytest.mark.parametrize("use_async_quorum", [True, False], ids=["async", "sync"])
def test_killed_group_restarts_heals_and_ends_identical(tmp_path, use_async_quorum):
    spec = JobSpec(steps=5, use_async_quorum=use_async_quorum)
    result = run_job(train_ddp, spec, [GroupPlan(0), GroupPlan(1, kill_at_step=2)], tmp_path)
    assert result.failures == {0: 0, 1: 1}
    assert_groups_identical(result.states, [0, 1])
    # min_replica_size=2: no step commits without both groups' data, so the kill only
    # delayed steps, and the result is the failure-free one.
    assert_failure_free(result.states, [0, 1], steps=5, async_init_sync=use_async_quorum)
    assert result.states[(0, 0)]["step"] == result.states[(1, 0)]["step"] == 5
    assert result.states[(1, 0)]["received_steps"], "the restarted group never healed"


def test_group_of_two_ranks_both_die_and_heal(tmp_path):
    spec = JobSpec(steps=4)
    result = run_job(
        train_ddp,
        spec,
        [GroupPlan(0, world_size=2), GroupPlan(1, world_size=2, kill_at_step=2)],
        tmp_path,
    )
    assert result.failures == {0: 0, 1: 1}
    assert_groups_identical(result.states, [0, 1], ranks=2)
    assert_failure_free(result.states, [0, 1], steps=4, ranks=2)


def test_recovery_over_pg_transport(tmp_path):
    spec = JobSpec(steps=4, transport="pg")
    result = run_job(train_ddp, spec, [GroupPlan(0), GroupPlan(1, kill_at_step=2)], tmp_path)
    assert result.failures == {0: 0, 1: 1}
    assert_groups_identical(result.states, [0, 1])
    assert_failure_free(result.states, [0, 1], steps=4)


def test_skip_init_sync_with_equal_seeds(tmp_path):
    spec = JobSpec(steps=4, init_sync=False, same_seed=True)
    result = run_job(train_ddp, spec, [GroupPlan(0), GroupPlan(1)], tmp_path)
    assert_groups_identical(result.states, [0, 1])
    # Equal seeds and no init_sync: nothing may move between the groups, at step 0 or later.
    for key in [(0, 0), (1, 0)]:
        assert result.states[key]["sent_steps"] == [], key
        assert result.states[key]["received_steps"] == [], key


def test_injected_allreduce_error_skips_exactly_that_step_on_the_group(tmp_path):
    spec = JobSpec(steps=4)
    result = run_job(
        train_ddp, spec, [GroupPlan(0), GroupPlan(1, fail_allreduce_at_step=2)], tmp_path
    )
    assert result.failures == {0: 0, 1: 0}
    assert result.states[(1, 0)]["failed_steps"] == [2]
    # The failing group skipped step 2 and was behind, so it healed from group 0 and caught up.
    assert_groups_identical(result.states, [0, 1])
    assert_failure_free(result.states, [0, 1], steps=4)


def test_matches_plain_torch_ddp_without_failures(tmp_path):
    steps = 5
    ft = run_job(
        train_ddp,
        JobSpec(steps=steps, init_sync=False, same_seed=True),
        [GroupPlan(0), GroupPlan(1)],
        tmp_path,
    )

    ctx = warm.mp_context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        ctx.Process(
            target=train_plain_ddp,
            args=(r, 2, store.port, steps, str(tmp_path / f"plain{r}.pt")),
            daemon=True,
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"plain DDP rank exited with {p.exitcode}"
    plain = torch.load(tmp_path / "plain0.pt", weights_only=True)["model"]
    for key, value in plain.items():
        torch.testing.assert_close(ft.states[(0, 0)]["model"][key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ft.states[(1, 0)]["model"][key], value, rtol=1e-5, atol=1e-6)


def test_checkpoint_corrupted_on_the_wire_is_rejected_and_healing_retries(tmp_path):
    # init_sync makes group 1 heal from group 0 at step 0; that first transfer passes through a
    # proxy that flips one byte. The corruption must be detected (step fails, nothing loaded),
    # the next step must heal cleanly, and both groups must end identical. min_replica_size=1 lets
    # group 0 commit alone while group 1 is still healing.
    spec = JobSpec(steps=4, min_replica_size=1)
    result = run_job(
        train_ddp, spec, [GroupPlan(0), GroupPlan(1, corrupt_first_heal=True)], tmp_path
    )
    assert result.failures == {0: 0, 1: 0}
    assert result.states[(1, 0)]["failed_steps"] == [0]
    assert result.states[(0, 0)]["failed_steps"] == []
    assert_groups_identical(result.states, [0, 1])
