"""A replica group cut off by a network partition: no split brain, and it heals afterwards.

Real processes in network namespaces this test creates (``netns.py``): a ``torchheal
lighthouse`` in a hub namespace behind a bridge, and three replica groups (the fail-fast
worker: one rank each, Gloo, fault-tolerant DDP, ``min_replica_size=1``), each in a namespace of
its own plugged into the bridge. The partition sets the victim's switch port down: no FIN, no
RST, nothing; its lighthouse session and its Gloo pairs stay open and go silent. So the
lighthouse learns of it only when its heartbeat expires.

The lighthouse runs with a heartbeat timeout of 2 s instead of the reference's 5 s, only to keep
the test short (the mechanism is the same at any value). The workers' collective timeout is
3 s. Where the cut finds the victim decides what it sees: in an allreduce with peers it can no
longer reach, it fails that step after the collective timeout and asks for a quorum; between
steps, its quorum request is in flight and simply gets no answer (its timeout is 60 s). Either
way it then waits on a session that carries nothing: every TCP connection of the victim backs
its retransmissions off exponentially while nothing gets through, so the old connection could
stay mute after the heal for about as long as the cut lasted. The link hangs a session up after
``SILENT_SESSION_S`` of silence and reopens it on a fresh connection (its request is asked
again), so the partition is made to last past both limits.

Checked, in order:

* the survivors go on without the victim (a quorum of two), which only the heartbeat's expiry
  can cause;
* the partition lasts past the collective timeout and the link's silence limit, and until the
  survivors have committed ``CUT_STEPS`` more steps after that: the victim commits nothing in
  that time (at most the step it had in flight when the cut came, which the survivors
  committed too);
* after the port comes up again, the victim (the same process: it was never restarted) rejoins,
  heals from a survivor (its first commit after the cut is a heal) and trains with the others;
* no split brain over the whole run: every committed step was committed by every group that
  committed it in one quorum with one divisor, the groups that contributed to it are as many
  as the divisor, and the steps are 0..N-1 (``replay.history``);
* every group ends bit-identical, with the weights the committed history produces (to 1e-4:
  Gloo sums three contributions in an order of its own).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.failfast.job import Event, Job
from tests.failfast.replay import CommittedStep, assert_identical, assert_replayed, history
from tests.failfast.test_kill import START_BOUND_S, all_together
from tests.partition.netjob import NetnsJob, hub_lighthouse
from tests.partition.netns import Network
from torchheal.coordination.session_client import SILENT_SESSION_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GROUPS = 3
VICTIM = 2
HEARTBEAT_TIMEOUT_MS = 2_000
COLLECTIVE_TIMEOUT_S = 3.0
#: Commits each survivor makes without the victim before we look at the victim.
ALONE_STEPS = 5
#: More commits the survivors make, while the victim is cut off, after ``CUT_LONG_S``.
CUT_STEPS = 20
#: The partition lasts at least this long: past the victim's collective timeout (a step in
#: flight has failed) and past its link's silence limit (its session is being reopened).
CUT_LONG_S = max(COLLECTIVE_TIMEOUT_S, SILENT_SESSION_S) + 1.0


def alone_commits(events: list[Event], group: int, since: float) -> list[Event]:
    """``group``'s commits after ``since`` in a quorum without the victim."""
    return [e for e in Job.commits(events, group, since=since) if e["reduce"]["divisor"] < GROUPS]


def assert_no_split_brain(steps: list[CommittedStep]) -> None:
    """Each committed step was reduced by exactly as many groups as it was divided by.

    ``history`` already failed if groups committed one step in different quorums or with
    different divisors, or if steps are missing.
    """
    for s in steps:
        if s.step == 0:
            # init_sync, as in the reference: every group at step 0 counts in the divisor, and
            # all but the primary heal from it (their reductions are zeroed).
            assert len(s.contributors) == 1 and len(s.committers) == s.divisor, s
            continue
        assert len(s.contributors) == s.divisor, f"step {s.step}: contributors vs divisor: {s}"


def test_partitioned_group_stops_then_heals(tmp_path: Path) -> None:
    network = Network(GROUPS)
    try:
        with hub_lighthouse(network, tmp_path / "lighthouse.log", HEARTBEAT_TIMEOUT_MS):
            job = NetnsJob(tmp_path, network, GROUPS, timeout_s=COLLECTIVE_TIMEOUT_S)
            try:
                run_partition(job, network)
            finally:
                job.close()
    finally:
        network.close()


def run_partition(job: NetnsJob, network: Network) -> None:
    for g in range(GROUPS):
        job.start(g)
    all_together(job, min_commits=3)
    survivors = [g for g in range(GROUPS) if g != VICTIM]

    network.cut(VICTIM)
    # Once the port is down: until then (the ``ip`` command takes a while) the group trains on.
    cut_at = time.time()
    job.wait_for(
        f"the survivors to commit {ALONE_STEPS} steps without the cut-off group "
        f"(its heartbeat expires after {HEARTBEAT_TIMEOUT_MS} ms)",
        lambda events: all(len(alone_commits(events, g, cut_at)) >= ALONE_STEPS for g in survivors),
        START_BOUND_S,
    )
    long_cut = cut_at + CUT_LONG_S
    job.wait_for(
        f"the survivors to commit {CUT_STEPS} more steps {CUT_LONG_S:.0f} s into the cut",
        lambda events: all(len(alone_commits(events, g, long_cut)) >= CUT_STEPS for g in survivors),
        START_BOUND_S,
    )
    heal_at = time.time()
    network.heal(VICTIM)

    cut_commits = Job.commits(job.events, VICTIM, since=cut_at)
    cut_commits = [e for e in cut_commits if e["time"] < heal_at]
    # At most the step in flight when the cut came, and only before its collective timed out.
    assert len(cut_commits) <= 1, f"the cut-off group committed while cut: {cut_commits}"
    assert all(e["time"] < cut_at + COLLECTIVE_TIMEOUT_S for e in cut_commits), cut_commits
    top = max(e["after"] for g in survivors for e in Job.commits(job.events, g, since=cut_at))

    all_together(job, min_commits=2, since=heal_at)
    assert len(job.procs[VICTIM]) == 1, "the cut-off group was restarted"
    back = Job.commits(job.events, VICTIM, since=heal_at)
    assert Job.healed_first(job.events, VICTIM, since=heal_at), (
        f"the cut-off group's first commit after the partition was not a heal: {back[0]}"
    )
    assert back[0]["after"] > top, (back[0], top)

    states = job.finish()
    steps = history(job.events)
    assert_no_split_brain(steps)
    assert_identical(states)
    assert_replayed(states[0], steps, exact=False)
