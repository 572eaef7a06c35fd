"""DiLoCo windows read every sample once through kills, a restart and a freeze (issue 44).

Three replica groups as real processes run DiLoCo over ``WindowGuard`` (``diloco_worker.py``:
a weight per sample, SGD with lr 1 inside and outside, so the global weights name the samples
every committed window read, ``-1/B`` each). One group is killed mid-run and restarted, another
frozen past the heartbeat timeout. A window read with a quorum its sync does not have must fail
and be read again, so at the end every group holds exactly ``-1/B`` on the samples of the plan's
first ``step * sync_every`` data steps (its own final step: the last group to leave may sync a
window alone), zero elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import Launch, lighthouse, supervise, url
from tests.data.diloco_worker import DiLoCoFaults, DiLoCoJob, run
from torchheal.data import DataPlan, StepKey, step_indices

FAULTS = {1: DiLoCoFaults(kill_at=2), 2: DiLoCoFaults(freeze_at=4)}


@pytest.mark.slow
def test_diloco_windows_read_each_sample_once(tmp_path: Path) -> None:
    with lighthouse(min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000) as lh:
        job = DiLoCoJob(lighthouse=url(lh), out_dir=str(tmp_path), faults=len(FAULTS))

        def start_rank(group: int, rank: int, incarnation: int, port: int):
            return run, (job, FAULTS.get(group, DiLoCoFaults()), group, incarnation, port)

        launches = [Launch(0), Launch(1, planned_kills=1), Launch(2)]
        restarts = supervise(start_rank, launches, deadline_s=200.0)
    assert restarts == {0: 0, 1: 1, 2: 0}
    assert len(list(tmp_path.glob("fault-*"))) == len(FAULTS)
    finals = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("final-g*.json"))]
    assert len(finals) == 3
    assert min(f["step"] for f in finals) >= job.steps
    # A fault made some sync's quorum differ from its window's: the guard failed it.
    assert max(f["stale_syncs"] for f in finals) > 0
    plan = DataPlan(job.dataset_size, job.batch_size, seed=3, inner_steps=job.sync_every)
    for f in finals:
        read = [
            i
            for s in range(f["step"])
            for j in range(job.sync_every)
            for i in step_indices(plan, StepKey(s, 1, 0, j))
        ]
        assert len(read) == len(set(read)) < job.dataset_size  # one epoch: each sample once
        want = [0.0] * job.dataset_size
        for i in read:
            want[i] = -1.0
        got = [round(v * job.batch_size, 4) for v in f["w"]]
        wrong = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        assert not wrong, f"samples read {[got[i] for i in wrong[:8]]} times: {wrong[:8]}"
