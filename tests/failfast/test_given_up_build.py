"""Groups left in a process-group build that a peer gave up never wait out their timeout.

Replica groups (real processes, as in ``test_kill.py``) at ``min_replicas=1``, join and tick
100 ms, the Managers' timeout at the reference's 60 s, and a heartbeat timeout of 60 s too, so
that no heartbeat expires within a test: every group stays alive throughout, and nobody is lost.

A group gives up its build of the process group for a new quorum (the worker's
``--fail-build-at-join``: the build raises before it publishes the group's address, as one does
whose connection to the rendezvous store was cut). The others wait in that build's rendezvous
for its address, which never comes. Two notices end their wait:

* the group's own report (``ConnectedQuorum.building`` -> ``GaveUp``): the lighthouse tells
  every group, as if it were lost from that quorum. The only way out with one group of two (no
  majority can leave the other out). A rank other than 0 reports through its manager server
  (the two-rank test; ``tests/coordination_io/test_session.py`` too), and a peer rank past the
  rendezvous, whose pair waits to be connected by a rank that abandoned the build, stops
  waiting (``end_pair_connects``).
* the lighthouse's word to a live group that a newer quorum went on without it
  (``SessionRegistry.on_issued``), where a majority gave the build up: g1 and g2 of three.
  Either notice frees g0 there (the reports usually first); the word alone does it with a
  lighthouse of session protocol 1, which takes no reports.

The two-group test is red without the report; the three-group test is red without both
notices (it waited for the 60 s timeout).

Checked: every group then trains in one quorum within a third of the 60 s timeout; all end
bit-identical, and as the replayed history (exactly with two contributions per step, to 1e-4
relative with three: Gloo sums three in an order of its own).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Event, Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import START_BOUND_S, all_together
from tests.failfast.test_salvage import assert_every_rank_on_its_history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: A third of the Manager's 60 s timeout, which a build left waiting would sit out.
REJOIN_BOUND_S = 20.0


def give_up_a_build(job: Job) -> tuple[int, float]:
    """Starts g0 and g1, then g2; g1 and g2 give up their first build of a quorum of all three.

    Both give up the same quorum's build unless g1's report of its own reaches g2 before g2's
    build starts: g2's build of that quorum is then abandoned for it, and g2 gives up the next.

    Returns:
        The latest of the quorums given up, and the wall time the second give-up came.
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
    assert all(e["quorum_id"] is not None for e in failing)
    return max(e["quorum_id"] for e in failing), max(e["time"] for e in failing)


def finish_and_check(job: Job, *, exact: bool) -> None:
    """Every group stops at one step, bit-identical, on the job's replayed history."""
    states = job.finish()
    assert_identical(states)
    steps = history(job.events)
    assert [e["step"] for e in job.events if e["kind"] == "done"] == [len(steps)] * job.groups
    assert_replayed(states[0], steps, exact=exact)


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
            ), "g0 committed in a quorum whose build was given up"
            finish_and_check(job, exact=False)
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
            finish_and_check(job, exact=True)
        finally:
            job.close()


def test_a_rank_of_a_two_rank_group_gives_up_its_build(tmp_path: Path) -> None:
    """Two groups of two ranks; rank 1 of g1 gives up its build (it reports through its manager
    server, ``ManagerNotices/ReportGaveUp``). Every rank of both groups abandons the build of
    that quorum, the ranks 0 too, whose own build may have been past its rendezvous by then:
    one of a pair waits to be connected by the other, which gave up (``end_pair_connects``;
    before it, 2 of 8 runs sat out the timeout there). Each rank ends on its own history,
    exactly."""
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=60_000
    ) as lh:
        job = Job(tmp_path, url(lh), 2, ranks=2, timeout_s=60.0)
        try:
            job.start(0)
            job.wait_for("g0 to commit", lambda events: bool(Job.commits(events, 0)), START_BOUND_S)
            job.start(1, per_rank={1: ("--fail-build-at-join",)})
            failing = job.wait_for(
                "g1's rank 1 to give up its build",
                lambda _events: next(
                    (e for e in job.rank_events if e["kind"] == "build-failing"), None
                ),
                START_BOUND_S,
            )
            all_together(job, min_commits=2, since=failing["time"], bound_s=REJOIN_BOUND_S)
            states = job.finish()
            assert_identical(states)
            assert_replayed(states[0], history(job.events), exact=True)
            assert_every_rank_on_its_history(job)
        finally:
            job.close()
