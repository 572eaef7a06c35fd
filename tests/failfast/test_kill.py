"""A SIGKILLed replica group: the survivors go on at once in a smaller quorum, the group heals.

Real processes (``tests.failfast.worker``: one rank per group, Gloo, fault-tolerant DDP,
``Manager(min_replica_size=1)``) against a real lighthouse at the reference's defaults
(``min_replicas=1``, join 100 ms, tick 100 ms) on loopback.

Each test holds the victim's restart back until the survivors have committed
``ALONE_STEPS`` steps in a quorum without it: that is the proof that they go on without waiting
for the restart (the restart only happens once they did). Then the victim restarts, heals from a
survivor and trains with the others, every group stops at a common full commit, and:

* every group's final weights are bit-identical;
* they are what the job's *actual* committed history produces (``replay.py``): for each committed
  step, the batches of the groups that contributed, summed, divided by the divisor the job used,
  stepped by the same optimizer. At ``min_replica_size=1`` a failure-free run is no reference:
  the survivors commit steps alone while the victim is down.

Two-group jobs run with a heartbeat timeout of 60 s: a dead group's heartbeat would expire long
after the test's bound on the survivors, so a survivor can only go on because the lighthouse
learnt at once that the group is gone (its session ended, the group's death certificate). With
one group of two left, the lighthouse's split-brain guard forbids any quorum while the dead one
still counts as healthy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Event, Job
from tests.failfast.replay import (
    assert_identical,
    assert_replayed,
    history,
    max_contributors,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Commits each survivor makes in a smaller quorum before the victim may restart.
ALONE_STEPS = 5
#: Bound on those commits. Far below the 60 s heartbeat timeout of the two-group jobs.
SURVIVORS_BOUND_S = 30.0
#: Bound on start-up (interpreters, torch) and on a restarted group's heal (a loaded machine).
START_BOUND_S = 90.0


def full(e: Event, groups: int) -> bool:
    """A commit in which every group of the job contributed."""
    r = e["reduce"]
    return r is not None and r["participating"] and r["divisor"] == groups


def all_together(
    job: Job, min_commits: int = 2, since: float = 0.0, bound_s: float = START_BOUND_S
) -> None:
    """Waits until every group's current incarnation made ``min_commits`` full commits.

    Args:
        job: the job.
        min_commits: full commits per group.
        since: count only commits after this wall time.
        bound_s: how long that may take.
    """

    def together(events: list[Event]) -> bool:
        return all(
            sum(
                1
                for e in Job.commits(events, g, since=since)
                if e["inc"] == job.current(g).incarnation and full(e, job.groups)
            )
            >= min_commits
            for g in range(job.groups)
        )

    job.wait_for("every group to train in one quorum", together, bound_s)


def survivors_go_on(job: Job, victim: int, since: float) -> None:
    """Waits until each survivor made ALONE_STEPS commits without the victim after ``since``."""
    survivors = [g for g in range(job.groups) if g != victim]

    def alone(events: list[Event]) -> bool:
        return all(
            sum(
                1
                for e in Job.commits(events, g, since=since)
                if e["reduce"]["divisor"] == job.groups - 1
            )
            >= ALONE_STEPS
            for g in survivors
        )

    job.wait_for(
        f"survivors {survivors} to commit {ALONE_STEPS} steps without g{victim} "
        f"(bound {SURVIVORS_BOUND_S:.0f}s)",
        alone,
        SURVIVORS_BOUND_S,
    )
    assert job.current(victim).popen.poll() is not None, "the victim is still running"


def heal_and_finish(job: Job, victim: int, *, exact: bool) -> None:
    """Restarts the victim; checks it healed, then the end state against the history."""
    restarted = job.start(victim)
    all_together(job)
    assert Job.healed_first(job.events, victim, inc=restarted.incarnation), (
        "the restarted group trained before it healed:\n" + job.describe()
    )
    states = job.finish()
    assert_identical(states)
    steps = history(job.events)
    assert [e["step"] for e in job.events if e["kind"] == "done"] == [len(steps)] * job.groups
    alone = [s for s in steps if s.divisor == job.groups - 1 and victim not in s.committers]
    assert len(alone) >= ALONE_STEPS, "the history shows no steps committed without the victim"
    if exact:
        assert max_contributors(steps) <= 2
    assert_replayed(states[0], steps, exact=exact)


def run_kill(tmp_path: Path, groups: int, victim: int, heartbeat_timeout_ms: int) -> None:
    with lighthouse(
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    ) as lh:
        job = Job(tmp_path, url(lh), groups)
        try:
            for g in range(groups):
                job.start(g)
            all_together(job, min_commits=3)
            killed_at = job.kill(victim)
            survivors_go_on(job, victim, since=killed_at)
            # Two contributions per step at most: a + b is exact in any order, so the replay
            # must match bit for bit. With three, Gloo's sum order may differ from the replay's.
            heal_and_finish(job, victim, exact=groups == 2)
        finally:
            job.close()


def test_sigkill_one_of_two_groups(tmp_path: Path) -> None:
    """One of two groups is SIGKILLed between or during steps (wherever the kill lands).

    Compared exactly: the final weights with each other and with the replayed history (no step
    has more than two contributions, and a + b is the same in any order; a healing group's zeros
    add exactly).
    """
    run_kill(tmp_path, groups=2, victim=1, heartbeat_timeout_ms=60_000)


def test_sigkill_one_of_three_groups(tmp_path: Path) -> None:
    """One of three groups is SIGKILLed; heartbeat timeout at the reference's default (5 s).

    Compared exactly: the final weights with each other. Compared to 1e-4 relative: the
    replayed history, because steps with three contributions are summed by Gloo's ring in an
    order of its own (float addition is not associative).
    """
    run_kill(tmp_path, groups=3, victim=2, heartbeat_timeout_ms=5_000)


def test_kill_inside_the_collective(tmp_path: Path) -> None:
    """A group SIGKILLs itself from inside its DDP comm hook, its allreduce started.

    The survivor is in the same collective when the kill lands; it must fail that step (or
    commit it, if the data was all through), go on without waiting for the 60 s heartbeat
    timeout, and the group must restart and heal. Compared exactly, as with two groups above.
    """
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=60_000
    ) as lh:
        job = Job(tmp_path, url(lh), 2)
        try:
            job.start(0)
            job.start(1, "--die-after", "3")
            job.expect_death(1)
            dying = job.wait_for(
                "g1 to kill itself inside its comm hook",
                lambda events: next((e for e in events if e["kind"] == "dying"), None),
                START_BOUND_S,
            )
            job.current(1).popen.wait(timeout=30)
            # The survivor entered the same collective (same step, same quorum).
            job.wait_for(
                "g0 to have entered the collective g1 died in",
                lambda events: any(
                    e["kind"] == "reduce"
                    and e["group"] == 0
                    and (e["step"], e["quorum_id"]) == (dying["step"], dying["quorum_id"])
                    for e in events
                ),
                SURVIVORS_BOUND_S,
            )
            survivors_go_on(job, 1, since=dying["time"])
            heal_and_finish(job, 1, exact=True)
        finally:
            job.close()


def test_kill_before_the_rebuild(tmp_path: Path) -> None:
    """A group joining two others dies between its quorum's answer and the group's rebuild.

    The survivors were answered the same quorum and are building its process group: without
    the lighthouse's notice reaching the build, their rendezvous waits for the dead group's
    address until the group's timeout (60 s here, past the survivors' bound; the heartbeat
    timeout is 60 s too). They must abandon the build, go on in a quorum of two, and the group
    must restart and heal. Compared exactly with each other; to 1e-4 with the replayed history
    (steps with three contributions).
    """
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=60_000
    ) as lh:
        job = Job(tmp_path, url(lh), 3, timeout_s=60.0)
        try:
            job.start(0)
            job.start(1)
            job.wait_for(
                "g0 and g1 to commit together",
                lambda events: all(
                    any(e["reduce"]["divisor"] == 2 for e in Job.commits(events, g)) for g in (0, 1)
                ),
                START_BOUND_S,
            )
            job.start(2, "--die-at-join")
            job.expect_death(2)
            dying = job.wait_for(
                "g2 to kill itself when answered a quorum of all three",
                lambda events: next((e for e in events if e["kind"] == "dying"), None),
                START_BOUND_S,
            )
            job.current(2).popen.wait(timeout=30)
            survivors_go_on(job, 2, since=dying["time"])
            heal_and_finish(job, 2, exact=False)
        finally:
            job.close()
