"""LocalSGD, DiLoCo and Streaming DiLoCo survive a SIGKILLed replica group (real processes).

Two replica groups run as separate processes (``tests/integration/jobs.py`` on ``tests/cluster.py``); group 1
SIGKILLs itself in the middle of a sync window, is restarted with a different random model,
heals from group 0 at its first quorum, and both must end at the same step with identical
state: the model for LocalSGD, the global weights and outer-optimizer state for DiLoCo.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.integration.jobs import GroupPlan, JobSpec, run_job
from tests.local_sgd_integ.test_threads import assert_same_global_state
from tests.local_sgd_integ.workers import TrainConfig, process_worker

pytestmark = pytest.mark.slow


def _run(cfg: TrainConfig, kill_at: int, tmp_path) -> list[dict]:
    result = run_job(
        functools.partial(process_worker, cfg),
        JobSpec(),
        [GroupPlan(0), GroupPlan(1, kill_at_step=kill_at)],
        tmp_path,
        deadline_s=90.0,
    )
    assert result.failures == {0: 0, 1: 1}
    states = [result.states[(0, 0)], result.states[(1, 0)]]
    assert states[0]["step"] == states[1]["step"] == cfg.outer_steps
    return states


def test_localsgd_recovery_models_equal(tmp_path) -> None:
    # Async quorum (LocalSGD's default use): the restarted group heals at its first sync.
    cfg = TrainConfig(
        algorithm="localsgd",
        sync_every=2,
        outer_steps=4,
        use_async_quorum=True,
        min_replica_size=1,
    )
    states = _run(cfg, kill_at=3, tmp_path=tmp_path)  # inner step 3: mid second window
    for name, tensor in states[0]["model"].items():
        torch.testing.assert_close(states[1]["model"][name], tensor, rtol=0, atol=0, msg=name)


def test_diloco_recovery_global_state_equal(tmp_path) -> None:
    cfg = TrainConfig(n_fragments=1, sync_every=4, outer_steps=3)
    states = _run(cfg, kill_at=6, tmp_path=tmp_path)  # 2 steps into the second window
    assert_same_global_state(states)
    # alpha 0 and one fragment: after the last sync the model is the global weights.
    for name, tensor in states[0]["fragments"][0]["original_parameters"].items():
        torch.testing.assert_close(states[1]["model"][name], tensor, rtol=0, atol=0)


def test_streaming_diloco_recovery_global_state_equal(tmp_path) -> None:
    # 2 fragments, delay 1, sync_every 4: each fragment's allreduce starts 1 step before its
    # merge. Killed before inner step 5, i.e. between fragment 0's allreduce and its merge.
    # PGTransport: see test_threads.test_http_transport_heal_with_streaming_delay.
    cfg = TrainConfig(
        n_fragments=2,
        sync_every=4,
        fragment_sync_delay=1,
        alpha=0.5,
        outer_steps=6,
        transport="pg",
    )
    states = _run(cfg, kill_at=5, tmp_path=tmp_path)
    assert_same_global_state(states)
