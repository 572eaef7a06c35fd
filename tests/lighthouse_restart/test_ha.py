"""A highly available lighthouse: two lighthouses on etcd, the active one SIGKILLed mid-training.

Real processes: etcd (Debian's ``etcd-server``, on loopback ports; the test fails, never skips,
without it), two ``torchheal lighthouse --etcd`` processes (the first leads, the second stands
by without listening), and two replica groups (``tests.failfast.worker``) given both addresses
(``http://A,http://B``). The leader is SIGKILLed while both groups train: within its lease the
standby takes over, the groups fail over to it and train on together, no group dies or heals,
quorum ids only go up, and at the end both groups hold the bit-identical weights that the
committed history produces.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.failfast.job import Event, Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import all_together, full
from tests.lighthouse_restart.etcd import etcd_server
from tests.lighthouse_restart.procs import LighthouseProcess
from tests.lighthouse_restart.test_restart import (
    AFTER_STEPS,
    GO_ON_BOUND_S,
    GROUPS,
    quorum_ids,
    report_pause,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LEASE_S = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_standby_lighthouse_takes_over_mid_training(tmp_path: Path) -> None:
    with etcd_server(tmp_path) as etcd:
        flags = ("--etcd", etcd, "--etcd-prefix", "/test/job", "--etcd-lease-s", str(LEASE_S))
        active = LighthouseProcess(tmp_path / "active.log", *flags)
        active.wait_log("This lighthouse leads")
        # The standby's port is chosen now: it only binds it once it leads.
        standby = LighthouseProcess(tmp_path / "standby.log", *flags, port=_free_port(), wait=False)
        job = Job(tmp_path, f"{active.url},{standby.url}", GROUPS)
        try:
            standby.wait_log("Standing by")
            for g in range(GROUPS):
                job.start(g)
            all_together(job, min_commits=3)
            killed_at = active.kill()
            standby.wait_serving(GO_ON_BOUND_S)
            serving_at = time.time()

            def go_on(events: list[Event]) -> bool:
                return all(
                    sum(1 for e in Job.commits(events, g, since=killed_at) if full(e, GROUPS))
                    >= AFTER_STEPS
                    for g in range(GROUPS)
                )

            try:
                job.wait_for("both groups to train on with the standby", go_on, GO_ON_BOUND_S)
            except AssertionError as e:
                raise AssertionError(f"{e}\n--- standby\n{standby.tail()}") from None
            report_pause(job.events, killed_at, serving_at, f"failover (lease {LEASE_S}s)")
            assert "Restored quorum" in standby.log.read_text()
            for g in range(GROUPS):
                assert len(job.procs[g]) == 1, f"g{g} was restarted"
                before = quorum_ids(job.events, g, until=killed_at)
                after = quorum_ids(job.events, g, since=killed_at)
                assert before == sorted(before) and after == sorted(after), (before, after)
                assert after[-1] > max(before), f"g{g}: quorum ids {before} then {after}"
                healed = [
                    e
                    for e in job.events
                    if e["kind"] == "reduce"
                    and e["group"] == g
                    and e["time"] > killed_at
                    and not e["participating"]
                ]
                assert not healed, f"g{g} healed after the failover: {healed[:3]}"
            states = job.finish()
            assert_identical(states)
            assert_replayed(states[0], history(job.events), exact=True)
        finally:
            job.close()
            active.stop()
            standby.stop()
