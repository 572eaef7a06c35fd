"""Every sample once, whatever fails: three replica groups as real processes, kills, restarts
and a frozen group, each committed step's samples checked against the plan and a failure-free
run (issue 44).

The groups read through ``StepLoader`` and report, per attempt, the samples that counted and
the gradient the job averaged (``worker.py``: one weight per sample, so the gradient names the
samples). For every committed step:

* the contributing groups' shares are disjoint and together are exactly the step's batch of
  the plan; with a constant global batch that batch is the failure-free run's, sample for
  sample, and the averaged gradient weighs each of its ``B`` samples ``1/B`` (exactly ``B``
  samples averaged, whoever read them); without it, the batch is the participants' ``b`` each,
  starting where the committed steps ended;
* across committed steps no sample is read twice, and the stream of committed samples is the
  plan's order from its start;
* the faults happened: a step failed with a group and was committed without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import Launch, lighthouse, supervise, url
from tests.data.worker import Faults, Job, run
from torchheal.data import DataPlan, Order, StepKey, step_indices

# Each at the first step from there on with all three groups: g1 dies, comes back; then g2
# freezes and comes back; then g0 (the lowest replica id, rank 0) dies and comes back.
FAULTS = {
    0: Faults(kill_at=16),
    1: Faults(kill_at=4),
    2: Faults(freeze_at=10),
}


def run_job(tmp: Path, constant: bool, faults: dict[int, Faults]) -> tuple[Job, list[dict]]:
    with lighthouse(min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000) as lh:
        job = Job(lighthouse=url(lh), out_dir=str(tmp), constant=constant, faults=len(faults))

        def start_rank(group: int, rank: int, incarnation: int, store_port: int):
            return run, (job, faults.get(group, Faults()), group, incarnation, store_port)

        launches = [
            Launch(g, planned_kills=int(faults.get(g, Faults()).kill_at is not None))
            for g in range(job.groups)
        ]
        restarts = supervise(start_rank, launches, deadline_s=200.0)
    killed = {g for g, f in faults.items() if f.kill_at is not None}
    assert {g for g, n in restarts.items() if n} == killed, restarts
    assert len(list(tmp.glob("fault-*"))) == len(faults), "a planned fault did not happen"
    records = [
        json.loads(line)
        for g in range(job.groups)
        for line in (tmp / f"g{g}.jsonl").read_text().splitlines()
    ]
    # Each restarted group healed (its step jumped); the first one then read shares again (the
    # later faults waited for it), the last one may be back only as the run ends.
    healed = {r["group"] for r in records if r["incarnation"] > 0 and r["after"] > r["before"] + 1}
    assert healed == killed, f"restarted groups that healed: {healed}"
    back = {r["group"] for r in records if r["incarnation"] > 0 and r["rank"] is not None}
    assert not killed or min(killed, key=lambda g: faults[g].kill_at or 0) in back, back
    return job, records


def committed_steps(job: Job, records: list[dict]) -> list[list[dict]]:
    """Per step every group has passed: the records of the groups that contributed and
    committed it (the faults may come after ``job.steps``: judge up to where all ended)."""
    final = min(max(r["after"] for r in records if r["group"] == g) for g in range(job.groups))
    assert final >= job.steps
    steps: list[list[dict]] = [[] for _ in range(final)]
    for r in records:
        if r["after"] == r["before"] + 1 and r["rank"] is not None and r["before"] < final:
            steps[r["before"]].append(r)
    for s, commits in enumerate(steps):
        assert commits, f"no contributing group recorded a commit of step {s}"
        quorums = {(c["participants"], c["batches_committed"]) for c in commits}
        assert len(quorums) == 1, f"step {s} committed twice, with {quorums}"
        assert sorted(c["rank"] for c in commits) == list(range(commits[0]["participants"]))
        commits.sort(key=lambda c: c["rank"])
    return steps


def check(job: Job, records: list[dict]) -> list[tuple[int, ...]]:
    plan = DataPlan(job.dataset_size, job.batch_size, job.constant, seed=11)
    history = []
    for s, commits in enumerate(committed_steps(job, records)):
        read = tuple(i for c in commits for i in c["indices"])
        k, bc = commits[0]["participants"], commits[0]["batches_committed"]
        want = step_indices(plan, StepKey(s, k, 0, 0, bc))
        assert read == want, f"step {s}: the shares of {k} groups are not the plan's batch"
        size = job.batch_size if job.constant else k * job.batch_size
        for c in commits:  # every group holds the same averaged gradient
            weights = {int(i): v for i, v in c["grad"].items()}
            # float32: 1/48 is not exact, 1/16 is; a sample missing or counted twice is 0 or 2x.
            want_w = {i: pytest.approx(job.batch_size / size, rel=1e-6) for i in read}
            assert weights == want_w, f"step {s} averaged {weights}"
        history.append(read)
    flat = [i for step in history for i in step]
    assert len(flat) == len(set(flat)), "a sample was read twice across committed steps"
    assert flat == list(Order(job.dataset_size, seed=11).indices(0, len(flat)))
    # The faults did what they were for: a step failed with a group, then committed without it.
    failed = {(r["before"], r["participants"]) for r in records if r["after"] == r["before"]}
    redone = [
        s
        for s, commits in enumerate(committed_steps(job, records))
        if any(fs == s and fk > commits[0]["participants"] for fs, fk in failed)
    ]
    assert redone, "no step failed with a group and was committed without it"
    return history


@pytest.mark.slow
def test_constant_batch_steps_equal_the_failure_free_run(tmp_path: Path) -> None:
    (tmp_path / "free").mkdir()
    (tmp_path / "faults").mkdir()
    job, free = run_job(tmp_path / "free", True, {})
    free_history = [tuple(i for c in cs for i in c["indices"]) for cs in committed_steps(job, free)]
    _, faulty = run_job(tmp_path / "faults", True, FAULTS)
    history = check(job, faulty)
    n = min(len(history), len(free_history))  # each run went on until all its groups ended
    assert n >= job.steps
    assert history[:n] == free_history[:n], "the committed steps differ from the failure-free run's"


@pytest.mark.slow
def test_per_group_batch_steps_are_the_participants_shares(tmp_path: Path) -> None:
    job, records = run_job(tmp_path, False, FAULTS)
    history = check(job, records)
    sizes = {len(step) for step in history}
    assert len(sizes) > 1, "every step had all groups: the batch never shrank"
