"""A transfer that stalls part way (one end frozen, its host as good as gone: no FIN) costs
neither end's peers the transport's 60 s socket timeout.

Three replica groups (real processes, as in ``test_kill.py``), each carrying 32 MiB of ballast
in its state so that a transfer outgrows the socket buffers, at ``min_replicas=1`` with the
reference's 60 s timeout. A healer stops reading after its first MiB (the worker's
``--hold-in-heal``), and the test SIGSTOPs one end of that transfer:

* **The healer** (``test_a_healer_frozen_mid_transfer_never_stalls_the_next_heal``): group 0
  trains alone, group 1 joins and heals from it and is frozen part way. Group 0's send of it
  stalls, and only that socket's timeout would end it. Group 2 then joins and must heal from
  group 0, the only group at the job's step: it heals and trains with group 0 well within that
  timeout (before the fix, group 0's next send waited for the stalled one to end). After SIGCONT
  the frozen group reads the rest of what it was sent (the source's copy of the step it asked
  for, kept until then), finds it was dropped, heals again and trains with the others.
* **The source** (``test_a_source_frozen_mid_transfer_releases_its_healer``): groups 0 and 2
  train together, group 1 joins and heals from group 0 (the plan's first up-to-date group), and
  group 0 is frozen part way. When its heartbeat expires the lighthouse tells the others; the
  healer aborts its receive at once (before the fix it waited out its socket's timeout), heals
  from group 2 and trains with it. Group 0, woken, does not commit the step it was frozen in
  (group 2 redid it without it: ``standing.py``), heals and rejoins.

The bound on each is 30 s, half the socket timeout. Every process exits by itself; all end
bit-identical and equal to the replayed history. The lighthouse runs with a heartbeat timeout of
2 s instead of 5 s, only to keep the tests short.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Event, Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import START_BOUND_S, all_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

GROUPS = 3
BALLAST = ("--ballast-mb", "32")
#: Half the transport's 60 s socket timeout: a heal released only by that timeout fails it.
HEAL_BOUND_S = 30.0


def trained_together(job: Job, groups: tuple[int, int], since: float, what: str) -> None:
    """Waits until both ``groups`` made 3 commits in a quorum of two after ``since``."""

    def together(events: list[Event]) -> bool:
        return all(
            sum(
                1
                for e in Job.commits(events, g, since=since)
                if e["reduce"]["participating"] and e["reduce"]["divisor"] == 2
            )
            >= 3
            for g in groups
        )

    job.wait_for(
        f"{what} (bound {HEAL_BOUND_S:.0f}s, sockets time out after 60s)", together, HEAL_BOUND_S
    )


@contextmanager
def stalled_job(tmp_path: Path) -> Iterator[Job]:
    """Both tests' job: a lighthouse at ``min_replicas=1``, join and tick 100 ms, a 2 s
    heartbeat timeout, and workers at the reference's 60 s timeout; closed at the end."""
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=2_000
    ) as lh:
        job = Job(tmp_path, url(lh), GROUPS, timeout_s=60.0)
        try:
            yield job
        finally:
            job.close()


def hold_in_heal(job: Job, healer: int, peers: tuple[int, ...], moved_on: bool = False) -> None:
    """Waits until ``healer`` holds part way into its heal and every group of its heal's quorum
    has reduced in it: their process group for that quorum is built, so a freeze that follows
    stalls the transfer, not the build. With ``moved_on``, the peers have also reduced in a
    later quorum (the one that leaves out the held healer): no build is under way among them
    either. (A group frozen while the others build their process group with it is another
    case, left open: stop 29's note on issue 9.)"""

    def reduced(events: list[Event]) -> bool:
        if not any(e["kind"] == "receiving" for e in events):
            return False
        quorum = next(
            (
                e["quorum_id"]
                for e in events
                if e["kind"] == "reduce" and e["group"] == healer and e["quorum_id"] >= 0
            ),
            None,
        )
        return quorum is not None and all(
            any(
                e["kind"] == "reduce"
                and e["group"] == g
                and (e["quorum_id"] > quorum if moved_on else e["quorum_id"] == quorum)
                for e in events
            )
            for g in peers
        )

    job.wait_for(f"g{healer} to hold part way into its heal", reduced, START_BOUND_S)


def test_a_healer_frozen_mid_transfer_never_stalls_the_next_heal(tmp_path: Path) -> None:
    SOURCE, STALLED, LATE = 0, 1, 2
    with stalled_job(tmp_path) as job:
        job.start(SOURCE, *BALLAST)
        job.wait_for(
            f"g{SOURCE} to commit alone",
            lambda events: len(Job.commits(events, SOURCE)) >= 3,
            START_BOUND_S,
        )
        job.start(STALLED, *BALLAST, "--hold-in-heal")
        hold_in_heal(job, STALLED, (SOURCE,))
        stopped_at = job.signal(STALLED, signal.SIGSTOP)
        job.start(LATE, *BALLAST)
        ready_at = job.wait_for(
            f"g{LATE}'s Manager",
            lambda events: next(
                (e["time"] for e in events if e["kind"] == "ready" and e["group"] == LATE),
                None,
            ),
            START_BOUND_S,
        )
        trained_together(
            job,
            (SOURCE, LATE),
            ready_at,
            f"g{LATE} to heal from g{SOURCE} and train with it while g{STALLED}'s transfer "
            "is stalled",
        )
        assert Job.healed_first(job.events, LATE), (
            f"g{LATE} trained before it healed:\n" + job.describe()
        )

        woken_at = job.signal(STALLED, signal.SIGCONT)
        job.release(STALLED)
        # Woken, the group's heal-step allreduce with g{SOURCE} (which cut it) fails at once.
        # At stop 29 it waited out its own 60 s timeout first in about 1 run in 7 (not seen in
        # 30 runs since stop 32: 18-28 s each): hence a bound past that timeout.
        all_together(job, min_commits=2, since=woken_at, bound_s=START_BOUND_S + 60.0)
        assert Job.healed_first(job.events, STALLED, since=stopped_at), (
            f"g{STALLED} trained after waking before it healed:\n" + job.describe()
        )
        states = job.finish()
        assert_identical(states)
        assert_replayed(states[0], history(job.events), exact=False)


def test_a_source_frozen_mid_transfer_releases_its_healer(tmp_path: Path) -> None:
    SOURCE, HEALER, OTHER = 0, 1, 2
    with stalled_job(tmp_path) as job:
        for g in (SOURCE, OTHER):
            job.start(g, *BALLAST)
        trained_together(job, (SOURCE, OTHER), 0.0, f"g{SOURCE} and g{OTHER} to start")
        job.start(HEALER, *BALLAST, "--hold-in-heal")
        hold_in_heal(job, HEALER, (SOURCE, OTHER), moved_on=True)
        stopped_at = job.signal(SOURCE, signal.SIGSTOP)
        job.release(HEALER)  # it reads what the socket holds, then waits on a frozen peer
        trained_together(
            job,
            (HEALER, OTHER),
            stopped_at,
            f"g{HEALER} to give up on frozen g{SOURCE}, heal from g{OTHER} and train with it",
        )
        aborted = job.current(HEALER).log.read_text()
        # Only frozen g{SOURCE} was lost meanwhile: an abort names it as the heal's source.
        assert "aborted (its source is gone)" in aborted, (
            f"g{HEALER} never aborted its receive from g{SOURCE}:\n" + job.describe()
        )

        woken_at = job.signal(SOURCE, signal.SIGCONT)
        # Woken, g{SOURCE} may be blocked in a collective that Gloo never wakes (its peers'
        # close notwithstanding): the lighthouse's word that it was dropped ends it, well
        # before the collective's 60 s timeout (it waited that out in 3 of 45 runs before).
        all_together(job, min_commits=2, since=woken_at, bound_s=HEAL_BOUND_S)
        healed_at = next(
            (
                e["time"]
                for e in job.events
                if e["kind"] == "step"
                and e["group"] == SOURCE
                and e["time"] > woken_at
                and (
                    (e["committed"] and not e["reduce"]["participating"])
                    or (not e["committed"] and e["after"] != e["before"])
                )
            ),
            None,
        )
        assert healed_at is not None, f"g{SOURCE} never healed after waking:\n" + job.describe()
        states = job.finish()
        assert_identical(states)
        # Woken, g{SOURCE}'s allreduce of the step it was frozen in may complete (it had all
        # of g{OTHER}'s data) while g{OTHER}, released by the lighthouse, redid that step
        # without it. Its vote is overruled then: had it committed, the history would hold
        # that step twice, in different ways, and this would fail.
        assert_replayed(states[0], history(job.events), exact=False)
