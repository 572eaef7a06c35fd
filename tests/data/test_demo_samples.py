"""The demo summary's exactly-once verdict, from the step events the groups report."""

from __future__ import annotations

from torchheal.data import DataPlan, StepKey, positions
from torchheal.launcher.demo.summary import check_samples, render, summarize
from torchheal.launcher.events import Event
from torchheal.launcher.records import GroupProcess, RunResult

B = 12


def read(group: int, step: int, k: int, rank: int | None, committed: bool = True) -> Event:
    lo, hi = positions(DataPlan(1, B), StepKey(step, k, rank))
    fields = {"committed": committed, "data_step": step, "rank": rank, "k": k, "batch": B}
    return Event("step", group, float(step), {**fields, "lo": lo, "hi": hi})


def test_a_job_that_lost_a_group_and_redid_a_step_read_each_sample_once() -> None:
    events = [read(g, 0, 3, g) for g in range(3)]
    events += [read(0, 1, 3, 0, committed=False), read(1, 1, 3, 1, committed=False)]
    events += [read(0, 1, 2, 0), read(1, 1, 2, 1)]  # step 1 again without group 2
    events += [read(2, 2, 2, None), read(0, 2, 2, 0), read(1, 2, 2, 1)]  # 2 heals
    check = check_samples(events)
    assert check is not None and check.problems == () and check.steps == 3
    result = RunResult(events, {g: GroupProcess(g) for g in range(3)}, 0.0, 1.0, False)
    assert "samples                each read once (3 committed steps x 12" in render(
        summarize(result)
    )


def test_a_step_committed_by_two_quorums_or_off_plan_is_called_out() -> None:
    twice = [read(0, 0, 1, 0), read(1, 0, 1, 0)]  # two groups each alone in step 0
    check = check_samples(twice)
    assert check is not None and "step 0 committed twice" in check.problems[0]
    shifted = read(0, 1, 1, 0)
    shifted.fields["lo"] -= 1  # a loader that read one sample of step 0 again
    check = check_samples([read(0, 0, 1, 0), shifted])
    assert check is not None
    assert any("the plan says" in p for p in check.problems)
    assert any("read twice" in p for p in check.problems)
    result = RunResult(twice, {0: GroupProcess(0), 1: GroupProcess(1)}, 0.0, 1.0, False)
    assert "samples                NOT each read once: step 0 committed twice" in render(
        summarize(result)
    )


def test_runs_that_report_no_reads_say_so() -> None:
    assert check_samples([Event("step", 0, 1.0, {"committed": True, "step": 1})]) is None
