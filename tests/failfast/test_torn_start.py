"""Replicas left torn at step 0 by a primary that died mid-transfer still start (issue 40, bug 2).

With ``init_sync`` every replica at step 0 receives the primary's initial state, in place (it
has nothing worth keeping). Real processes, 32 MiB of ballast so that a transfer outgrows the
socket buffers: group 0 (the primary, first by replica id) and group 1 start together; group 1
holds part way into its receive (the worker's ``--hold-in-heal``) and group 0 is SIGKILLed, so
group 1 is torn. Group 2 then joins at step 0: the plan makes group 1, first by replica id, the
source. It used to refuse (a torn replica sent nothing and committed nothing), the same plan came
back every round, and no step ever committed. Now its state becomes the initial state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Job
from tests.failfast.test_kill import START_BOUND_S
from tests.failfast.test_stalled_transfer import BALLAST, hold_in_heal, trained_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_torn_replicas_at_step_0_start_when_their_primary_died(tmp_path: Path) -> None:
    PRIMARY, TORN, LATE = 0, 1, 2
    with lighthouse(
        min_replicas=2, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=2_000
    ) as lh:
        job = Job(tmp_path, url(lh), 3, timeout_s=60.0)
        try:
            job.start(PRIMARY, *BALLAST)
            job.start(TORN, *BALLAST, "--hold-in-heal")
            hold_in_heal(job, TORN, (PRIMARY,))
            killed = job.kill(PRIMARY)
            job.release(TORN)
            job.wait_for(
                f"g{TORN} to find its receive torn",
                lambda events: any(
                    e["kind"] == "step" and e["group"] == TORN and e["time"] > killed
                    for e in events
                ),
                START_BOUND_S,
            )
            job.start(LATE, *BALLAST)
            trained_together(job, (TORN, LATE), killed, f"g{TORN} and g{LATE} to train")
        finally:
            job.close()
