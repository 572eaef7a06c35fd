"""A group frozen (SIGSTOP) in the middle of a step never hangs the job, nor splits it.

Three replica groups (real processes, as in ``test_kill.py``) train at ``min_replicas=1`` with a
60 s collective timeout. Group 2 enters its DDP comm hook and stops there before sending its
data (the worker's ``--hold-after``: it writes a ``reducing`` line, then waits); the test
SIGSTOPs it at that marker. The two others are in the same allreduce, waiting for its data, and a
frozen process keeps its sockets open: nothing but the lighthouse can release them.

The lighthouse runs with a heartbeat timeout of 2 s instead of the reference's 5 s, only to keep
the test short: the mechanism is the same at any value (the frozen group stops heartbeating, the
lighthouse drops it when its heartbeat expires and tells every session that a member of the
quorum is lost; each survivor's Manager aborts its cross-replica group, which cuts the Gloo pair
sockets, so the allreduce fails now instead of at its 60 s timeout).

Checked: the survivors entered the frozen group's collective and that step did not commit for
them; they then commit steps without it well within the collective's timeout (the test's bound,
30 s, is half of it); after SIGCONT the frozen group finds its collective broken, rejoins, heals
and trains with the others; every process exits by itself; all end bit-identical. Final weights
are also compared with the replayed history, to 1e-4 relative (steps with three contributions are
summed by Gloo in an order of its own).

The second test freezes a group *after* its allreduce completed, before its vote, while every
peer's same step failed (the worker's ``--fail-reduce``: the allreduce completes but reports a
failure, as one does whose connection was cut just after the last byte). The peers wait for the
frozen group until its heartbeat expires (the join timeout is the reference's 60 s), then redo
the step without it. Woken, the frozen group holds a complete allreduce and would vote yes: it
must not commit that step, which its peers committed another way (``standing.py``), but heal.

The third freezes the group that hosts the rendezvous store of the quorum being built: g0 stops
itself as a killed group rejoins, right after that quorum is answered (the worker's
``--stop-at-rejoin``), and g0, the first up-to-date group, hosts its store. A frozen host accepts
connections and never answers, so the others' builds would wait for the store's timeout. They
must go on without it once the lighthouse drops it; and woken, the host must not wait for them
in its own build of that quorum.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Event, Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import START_BOUND_S, all_together, survivors_go_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GROUPS = 3
VICTIM = 2
ALONE_STEPS = 5
#: Half the collectives' 60 s timeout: a survivor released only by that timeout fails the bound.
RELEASE_BOUND_S = 30.0


def test_sigstop_inside_an_allreduce(tmp_path: Path) -> None:
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=2_000
    ) as lh:
        job = Job(tmp_path, url(lh), GROUPS, timeout_s=60.0)
        try:
            for g in range(GROUPS):
                job.start(g, *(["--hold-after", "3"] if g == VICTIM else []))
            held = job.wait_for(
                f"g{VICTIM} to hold inside its comm hook",
                lambda events: next((e for e in events if e["kind"] == "reducing"), None),
                START_BOUND_S,
            )
            stopped_at = job.signal(VICTIM, signal.SIGSTOP)
            survivors = [g for g in range(GROUPS) if g != VICTIM]
            collective = (held["step"], held["quorum_id"])

            def entered(events: list[Event]) -> bool:
                return all(
                    any(
                        e["kind"] == "reduce"
                        and e["group"] == g
                        and (e["step"], e["quorum_id"]) == collective
                        for e in events
                    )
                    for g in survivors
                )

            job.wait_for("the survivors to enter the frozen group's collective", entered, 30.0)

            def released(events: list[Event]) -> bool:
                return all(
                    sum(
                        1
                        for e in Job.commits(events, g, since=stopped_at)
                        if e["reduce"]["divisor"] == GROUPS - 1
                    )
                    >= ALONE_STEPS
                    for g in survivors
                )

            job.wait_for(
                f"the survivors to commit {ALONE_STEPS} steps without the frozen group "
                f"(bound {RELEASE_BOUND_S:.0f}s, collectives time out after 60s)",
                released,
                RELEASE_BOUND_S,
            )
            for g in survivors:
                attempt = next(
                    e
                    for e in job.events
                    if e["kind"] == "step"
                    and e["group"] == g
                    and e["reduce"] is not None
                    and (e["reduce"]["step"], e["reduce"]["quorum_id"]) == collective
                )
                assert not attempt["committed"], f"g{g} committed the frozen collective: {attempt}"

            woken_at = job.signal(VICTIM, signal.SIGCONT)
            job.release(VICTIM)
            all_together(job, min_commits=2, since=woken_at)
            assert Job.healed_first(job.events, VICTIM, since=stopped_at), (
                "the frozen group trained after waking before it healed:\n" + job.describe()
            )
            states = job.finish()
            assert_identical(states)
            assert_replayed(states[0], history(job.events), exact=False)
        finally:
            job.close()


def test_a_group_frozen_before_its_vote_never_commits_the_step_its_peers_redid(
    tmp_path: Path,
) -> None:
    peers = [g for g in range(GROUPS) if g != VICTIM]
    with lighthouse(
        min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=100, heartbeat_timeout_ms=2_000
    ) as lh:
        job = Job(tmp_path, url(lh), GROUPS, timeout_s=60.0)
        try:
            for g in peers:
                job.start(g, "--fail-reduce", "3")
            job.start(VICTIM, "--hold-reduced", "3")
            held = job.wait_for(
                f"g{VICTIM} to hold with its allreduce complete, before its vote",
                lambda events: next((e for e in events if e["kind"] == "reduced"), None),
                START_BOUND_S,
            )
            stopped_at = job.signal(VICTIM, signal.SIGSTOP)
            assert not held["errored"], f"g{VICTIM}'s allreduce failed: {held}"

            def redone(events: list[Event]) -> bool:
                return all(
                    any(
                        e["reduce"]["step"] == held["step"] and e["reduce"]["divisor"] == 2
                        for e in Job.commits(events, g, since=stopped_at)
                    )
                    for g in peers
                )

            job.wait_for(
                f"g{peers} to redo step {held['step']} without frozen g{VICTIM}",
                redone,
                RELEASE_BOUND_S,
            )
            woken_at = job.signal(VICTIM, signal.SIGCONT)
            job.release(VICTIM)
            all_together(job, min_commits=2, since=woken_at)
            attempt = next(
                e
                for e in job.events
                if e["kind"] == "step"
                and e["group"] == VICTIM
                and e["reduce"] is not None
                and e["reduce"]["quorum_id"] == held["quorum_id"]
                and e["reduce"]["step"] == held["step"]
            )
            assert not attempt["committed"], (
                f"g{VICTIM} committed, after waking, the step its peers redid without it: "
                f"{attempt}\n" + job.describe()
            )
            log = job.current(VICTIM).log.read_text()
            assert "although every rank voted yes" in log, log[-3000:]
            assert Job.healed_first(job.events, VICTIM, since=woken_at), (
                f"g{VICTIM} trained after waking before it healed:\n" + job.describe()
            )
            states = job.finish()
            assert_identical(states)
            assert_replayed(states[0], history(job.events), exact=False)
        finally:
            job.close()


#: The workers' collective and store timeout in the store-host test: a build that waits for
#: the frozen store host until this timeout fails the bound below.
STORE_TIMEOUT_S = 20.0
#: From the host's freeze to a survivor's commit in a quorum without it: its heartbeat timeout
#: (2 s), then a quorum and a build. (The rejoining group, which was to heal from the frozen
#: host, gives up its metadata request at the notice: waiting out its connect timeout, 10 s,
#: would fail this too, since the survivor's next quorum waits for it.)
STORE_HOST_BOUND_S = 8.0
#: From the host's wake to every group's third full commit.
WOKEN_BOUND_S = 10.0


def freeze_the_store_host_at_a_rejoin(
    job: Job, without_host_bound_s: float, woken_bound_s: float
) -> None:
    """The store-host scenario on a job of 3 groups: g0 stops itself as a killed g1 rejoins,
    right after the quorum its store serves is answered. g2 must commit in a quorum without g0
    within ``without_host_bound_s`` of the freeze; once g0 is woken, every group must make 3
    full commits within ``woken_bound_s``; all end bit-identical and on the replayed history."""
    host, victim, survivor = 0, 1, 2
    job.start(host, "--stop-at-rejoin")
    for g in (victim, survivor):
        job.start(g)
    all_together(job, min_commits=3)
    killed = job.kill(victim)
    survivors_go_on(job, victim, since=killed)
    job.start(victim)
    stopping = job.wait_for(
        f"g{host} to stop itself as g{victim} rejoins",
        lambda events: next((e for e in events if e["kind"] == "stopping"), None),
        START_BOUND_S,
    )

    def without_the_host(events: list[Event]) -> Event | None:
        return next(
            (
                e
                for e in Job.commits(events, survivor, since=stopping["time"])
                if e["reduce"]["quorum_id"] > stopping["quorum_id"]
            ),
            None,
        )

    went_on = job.wait_for(
        f"g{survivor} to commit in a quorum without the frozen store host (the store's "
        f"timeout is {job.timeout_s:.0f}s)",
        without_the_host,
        without_host_bound_s,
    )
    assert went_on["reduce"]["divisor"] < GROUPS, went_on
    woken_at = job.signal(host, signal.SIGCONT)
    all_together(job, min_commits=3, since=woken_at, bound_s=woken_bound_s)
    states = job.finish()
    assert_identical(states)
    assert_replayed(states[0], history(job.events), exact=False)


def test_a_frozen_store_host_holds_the_others_build_only_until_it_is_dropped(
    tmp_path: Path,
) -> None:
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=2_000
    ) as lh:
        job = Job(tmp_path, url(lh), GROUPS, timeout_s=STORE_TIMEOUT_S)
        try:
            # Woken, the host hears it was dropped from that quorum and abandons its own build,
            # which waits for peers that left (until the store's timeout, else).
            freeze_the_store_host_at_a_rejoin(job, STORE_HOST_BOUND_S, WOKEN_BOUND_S)
        finally:
            job.close()
