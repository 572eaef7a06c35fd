"""A healer that freezes part way through its transfer never stalls its source's next heal.

Three replica groups (real processes, as in ``test_kill.py``), each carrying 32 MiB of ballast
in its state so that a transfer outgrows the socket buffers, at ``min_replicas=1`` with the
reference's 60 s timeout. Group 0 trains alone; group 1 joins, heals from it, and stops reading
after its first MiB (the worker's ``--hold-in-heal``); the test SIGSTOPs it there. Its host is
as good as gone without a FIN: its socket stays open, group 0's send of it stalls, and only that
socket's 60 s timeout would end it. Group 2 then joins and must heal from group 0, the only group
at the job's step.

Checked: group 2 heals and trains with group 0 well within that timeout (the test's bound, 30 s,
is half of it; before the fix, group 0's next send waited for the stalled one to end). After
SIGCONT the frozen group reads the rest of what it was sent (the source's copy of the step it
asked for, kept until then), finds it was dropped, heals again and trains with the others; every
process exits by itself; all end bit-identical and equal to the replayed history.

The lighthouse runs with a heartbeat timeout of 2 s instead of 5 s, only to keep the test short.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Event, Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import START_BOUND_S, all_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GROUPS = 3
SOURCE, STALLED, LATE = 0, 1, 2
BALLAST = ("--ballast-mb", "32")
#: Half the transport's 60 s socket timeout: a heal released only by that timeout fails it.
HEAL_BOUND_S = 30.0


def test_a_healer_frozen_mid_transfer_never_stalls_the_next_heal(tmp_path: Path) -> None:
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=2_000
    ) as lh:
        job = Job(tmp_path, url(lh), GROUPS, timeout_s=60.0)
        try:
            job.start(SOURCE, *BALLAST)
            job.wait_for(
                f"g{SOURCE} to commit alone",
                lambda events: len(Job.commits(events, SOURCE)) >= 3,
                START_BOUND_S,
            )
            job.start(STALLED, *BALLAST, "--hold-in-heal")
            job.wait_for(
                f"g{STALLED} to hold part way into its heal",
                lambda events: any(e["kind"] == "receiving" for e in events),
                START_BOUND_S,
            )
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

            def together(events: list[Event]) -> bool:
                return all(
                    sum(
                        1
                        for e in Job.commits(events, g, since=ready_at)
                        if e["reduce"]["participating"] and e["reduce"]["divisor"] == 2
                    )
                    >= 3
                    for g in (SOURCE, LATE)
                )

            job.wait_for(
                f"g{LATE} to heal from g{SOURCE} and train with it while g{STALLED}'s transfer "
                f"is stalled (bound {HEAL_BOUND_S:.0f}s from g{LATE}'s Manager, the socket "
                "times out after 60s)",
                together,
                HEAL_BOUND_S,
            )
            assert Job.healed_first(job.events, LATE), (
                f"g{LATE} trained before it healed:\n" + job.describe()
            )

            woken_at = job.signal(STALLED, signal.SIGCONT)
            job.release(STALLED)
            all_together(job, min_commits=2, since=woken_at)
            assert Job.healed_first(job.events, STALLED, since=stopped_at), (
                f"g{STALLED} trained after waking before it healed:\n" + job.describe()
            )
            states = job.finish()
            assert_identical(states)
            assert_replayed(states[0], history(job.events), exact=False)
        finally:
            job.close()
