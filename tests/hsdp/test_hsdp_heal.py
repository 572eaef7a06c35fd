"""Fault-tolerant HSDP end to end on CPU/Gloo: 2 replica groups x 2 ranks, FSDP2 over
``["dp_replicate", "dp_shard"]``, gradient reduction across replicas through the Manager.

Replica group 1 is SIGKILLed in the middle of a step and started again (a fresh TCPStore, as a
restarted torchrun job gets). It must heal live from group 0, after which both groups hold
identical shards, and the run must end exactly where a plain HSDP run over the same data ends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hsdp.jobs import load, run_ft_with_restart, run_plain_job, tensors

pytestmark = pytest.mark.slow

GROUPS = 2
RANKS = 2
STEPS = 5
KILL_AT = 2
DEADLINE_S = 150


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs the fault-tolerant job with a failure, then the plain job; returns the output dir."""
    out = tmp_path_factory.mktemp("hsdp")
    run_ft_with_restart(
        out, GROUPS, RANKS, STEPS, kill_group=1, kill_at=KILL_AT, deadline_s=DEADLINE_S
    )
    run_plain_job(out, GROUPS, RANKS, STEPS, deadline_s=DEADLINE_S)
    return out


@pytest.mark.parametrize("rank", range(RANKS))
def test_restarted_group_healed_and_finished(runs: Path, rank: int) -> None:
    healed = load(runs / f"ft_g1_r{rank}.pt")
    survivor = load(runs / f"ft_g0_r{rank}.pt")
    assert healed["step"] == survivor["step"] == STEPS
    # The restarted group healed once, live, to the step the survivor was retrying ...
    assert healed["healed"] == [KILL_AT]
    # ... and the survivor never healed after the start (step 0 sync is allowed: init_sync).
    assert all(step == 0 for step in survivor["healed"])
    # The survivor's reduction at the killed step failed, so it retried that step.
    assert set(survivor["failed_steps"]) == {KILL_AT}


@pytest.mark.parametrize("rank", range(RANKS))
def test_shards_identical_across_replicas(runs: Path, rank: int) -> None:
    a = tensors(load(runs / f"ft_g0_r{rank}.pt"))
    b = tensors(load(runs / f"ft_g1_r{rank}.pt"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("group", range(GROUPS))
@pytest.mark.parametrize("rank", range(RANKS))
def test_same_result_as_plain_hsdp(runs: Path, group: int, rank: int) -> None:
    ft = tensors(load(runs / f"ft_g{group}_r{rank}.pt"))
    plain = tensors(load(runs / f"plain_g{group}_r{rank}.pt"))
    assert ft.keys() == plain.keys()
    for key in ft:
        torch.testing.assert_close(ft[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)
