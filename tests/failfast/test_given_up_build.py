"""A group left alone in a process-group build that its peers gave up never waits out its timeout.

Three replica groups (real processes, as in ``test_kill.py``) at ``min_replicas=1``, join and
tick 100 ms, the Manager's timeout at the reference's 60 s, and a heartbeat timeout of 60 s too,
so that no heartbeat expires within the test: every group stays alive throughout.

g0 and g1 train together; g2 starts and joins them. g1 and g2 then give up their build of the
process group for the quorum of all three (the worker's ``--fail-build-at-join``: the build
raises before it publishes the group's address, as one does whose connection to the rendezvous
store was cut). g0 is left in that build's rendezvous, waiting for their addresses, which never
come. g1 and g2 ask again and, after the wait for late members, are issued a quorum without g0,
which is alive but had not asked. Nothing is lost, so no ``MemberLost`` notice about another
group would reach g0; only the lighthouse's word that a newer quorum went on without it
(``SessionRegistry.on_issued``) ends its build, and it rejoins. Without it, g0 would wait for
its 60 s timeout: the bound here is a third of it.

Checked: the two failed builds were of the same quorum; every group then trains in one quorum
within the bound; all end bit-identical, and as the replayed history to 1e-4 relative (steps with
three contributions are summed by Gloo in an order of its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Event, Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import START_BOUND_S, all_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: A third of the Manager's 60 s timeout, which a build left waiting would sit out.
REJOIN_BOUND_S = 20.0


def give_up_a_build(job: Job) -> tuple[int, float]:
    """Starts g0 and g1, then g2; g1 and g2 give up the build of the quorum of all three.

    Returns:
        That quorum's id, and the wall time the second of them gave it up.
    """
    job.start(0)
    job.start(1, "--fail-build-at-join")
    job.wait_for(
        "g0 and g1 to commit together",
        lambda events: all(
            any(e["reduce"]["divisor"] == 2 for e in Job.commits(events, g)) for g in (0, 1)
        ),
        START_BOUND_S,
    )
    job.start(2, "--fail-build-at-join")

    def both_failed(events: list[Event]) -> list[Event] | None:
        failing = [e for e in events if e["kind"] == "build-failing"]
        return failing if len(failing) == 2 else None

    failing = job.wait_for("g1 and g2 to give up their build", both_failed, START_BOUND_S)
    assert sorted(e["group"] for e in failing) == [1, 2]
    assert failing[0]["quorum_id"] == failing[1]["quorum_id"] is not None
    return failing[0]["quorum_id"], max(e["time"] for e in failing)


def test_a_group_whose_peers_gave_up_its_build_is_not_left_waiting(tmp_path: Path) -> None:
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=60_000
    ) as lh:
        job = Job(tmp_path, url(lh), 3, timeout_s=60.0)
        try:
            given_up, since = give_up_a_build(job)
            all_together(job, min_commits=2, since=since, bound_s=REJOIN_BOUND_S)
            assert all(
                e["reduce"]["quorum_id"] > given_up for e in Job.commits(job.events, 0, since=since)
            ), "g0 committed in the quorum whose build was given up"
            states = job.finish()
            assert_identical(states)
            steps = history(job.events)
            assert [e["step"] for e in job.events if e["kind"] == "done"] == [len(steps)] * 3
            assert_replayed(states[0], steps, exact=False)
        finally:
            job.close()


def test_one_of_two_groups_gives_up_its_build(tmp_path: Path) -> None:
    """The common case: one group's build fails, and the other, alive in the rendezvous,
    cannot be left out of a quorum (one group of two is no majority). Only the failing group's
    own report (``ConnectedQuorum.building`` -> ``GaveUp``) ends the other's wait: the
    lighthouse tells it, as if the group were lost from that quorum. Compared exactly: no step
    has more than two contributions."""
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=60_000
    ) as lh:
        job = Job(tmp_path, url(lh), 2, timeout_s=60.0)
        try:
            job.start(0)
            job.wait_for(
                "g0 to commit",
                lambda events: bool(Job.commits(events, 0)),
                START_BOUND_S,
            )
            job.start(1, "--fail-build-at-join")
            failing = job.wait_for(
                "g1 to give up its build",
                lambda events: next((e for e in events if e["kind"] == "build-failing"), None),
                START_BOUND_S,
            )
            all_together(job, min_commits=2, since=failing["time"], bound_s=REJOIN_BOUND_S)
            states = job.finish()
            assert_identical(states)
            steps = history(job.events)
            assert [e["step"] for e in job.events if e["kind"] == "done"] == [len(steps)] * 2
            assert_replayed(states[0], steps, exact=True)
        finally:
            job.close()
