"""Fault-tolerant DDP with the model on the GPU: the kill-and-heal of ``test_ddp_e2e`` on CUDA.

One GPU holds every replica group, so the groups talk through Gloo over CUDA tensors (NCCL
refuses two ranks of one communicator on one device); NCCL is covered by a job of one group,
where the Manager configures it, reduces through it and commits. The healed state crosses the
wire from GPU memory (HTTP and PG transports) and lands back on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.jobs import GroupPlan, JobSpec, run_job
from tests.integration.test_ddp_e2e import assert_groups_identical
from tests.integration.workers import failure_free, train_ddp

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 5


def assert_close_to_failure_free(states: dict, groups: list[int]) -> None:
    """The CPU replay of a failure-free run, up to the GPU's own rounding (other kernels)."""
    expected = failure_free(STEPS, 0, len(groups))
    for g in groups:
        for key, value in expected.items():
            torch.testing.assert_close(
                states[(g, 0)]["model"][key], value, rtol=1e-4, atol=1e-5, msg=f"g{g} {key}"
            )


@pytest.mark.parametrize("transport", ["http", "pg"])
def test_killed_group_heals_from_gpu_memory(tmp_path, transport: str) -> None:
    spec = JobSpec(steps=STEPS, device="cuda", transport=transport)
    result = run_job(
        train_ddp, spec, [GroupPlan(0), GroupPlan(1, kill_at_step=2)], tmp_path, deadline_s=240
    )
    assert result.failures == {0: 0, 1: 1}
    assert result.states[(1, 0)]["received_steps"], "the restarted group never healed"
    assert result.states[(0, 0)]["step"] == result.states[(1, 0)]["step"] == STEPS
    assert_groups_identical(result.states, [0, 1])
    assert_close_to_failure_free(result.states, [0, 1])


def test_one_group_trains_through_nccl(tmp_path) -> None:
    spec = JobSpec(steps=STEPS, device="cuda", backend="nccl", min_replica_size=1)
    result = run_job(train_ddp, spec, [GroupPlan(0)], tmp_path, min_replicas=1, deadline_s=240)
    state = result.states[(0, 0)]
    assert state["step"] == STEPS and state["failed_steps"] == []
    assert_close_to_failure_free(result.states, [0])
