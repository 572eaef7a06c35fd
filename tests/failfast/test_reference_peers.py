"""Reference (torchft) replica groups on a torchheal lighthouse keep the reference's semantics.

A torchft manager server talks to the lighthouse with the reference's unary ``Heartbeat`` and
``Quorum`` calls, never with a torchheal session, so the lighthouse has no death certificate for
it: a SIGKILLed torchft group is dropped when its heartbeat expires, exactly as on the
reference's own lighthouse, and the survivor goes on then.

Two groups run the same worker as the other fail-fast tests on the reference's Manager, DDP and
optimizer wrapper (the installed torchft-nightly; in CI a missing reference fails this module).
The lighthouse runs in this process with an observer, so the test sees its decisions: the first
quorum without the victim is issued no earlier than a heartbeat timeout after the victim's last
heartbeat, and the victim is never announced lost for a session's end. The
heartbeat timeout is 2 s instead of the reference's 5 s to keep the test short; the rule is the
same. Then the victim restarts and heals through the reference's own recovery, and, as in
``test_kill.py``, all groups end bit-identical and equal to the replayed history (exactly: two
groups).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Job
from tests.failfast.test_kill import all_together, heal_and_finish, survivors_go_on
from tests.reference import import_reference

import_reference("torchft")

pytestmark = [pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(300)]

HEARTBEAT_TIMEOUT_S = 2.0


class Recorder:
    """A lighthouse observer that keeps what the test checks (times are ``time.monotonic()``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_heartbeat: dict[str, float] = {}
        self.quorums: list[tuple[float, list[str]]] = []
        self.lost: list[tuple[str, str]] = []

    def heartbeat(self, replica_id: str) -> None:
        with self.lock:
            self.last_heartbeat[replica_id] = time.monotonic()

    def joined(self, member: Any, now: float) -> None:
        with self.lock:
            self.last_heartbeat[member.replica_id] = time.monotonic()  # a request beats too

    def quorum_issued(self, quorum: Any, reason: str, round_s: float, now: float) -> None:
        with self.lock:
            self.quorums.append((now, [m.replica_id for m in quorum.participants]))

    def expired(self, replica_id: str, last_seen: float, now: float) -> None:
        pass

    def reason_changed(self, reason: str, now: float) -> None:
        pass

    def lost(self, replica_id: str, reason: str, now: float) -> None:
        with self.lock:
            self.lost.append((replica_id, reason))


def test_killed_torchft_group_is_dropped_when_its_heartbeat_expires(tmp_path: Path) -> None:
    recorder = Recorder()
    with lighthouse(
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000),
        observer=recorder,
    ) as lh:
        job = Job(tmp_path, url(lh), 2, impl="torchft")
        try:
            job.start(0)
            job.start(1)
            all_together(job, min_commits=3)
            with recorder.lock:
                (victim,) = {rid for _, ids in recorder.quorums for rid in ids if rid[:3] == "g1:"}
            killed_at_mono = time.monotonic()
            killed_at = job.kill(1)
            survivors_go_on(job, 1, since=killed_at)
            with recorder.lock:
                last_beat = recorder.last_heartbeat[victim]
                first_without = next(
                    t for t, ids in recorder.quorums if t > killed_at_mono and victim not in ids
                )
                lost = [reason for rid, reason in recorder.lost if rid == victim]
            # No session, so never "connection ended". (When the tick that sees the expiry also
            # issues the survivor's new quorum, the lighthouse announces nothing at all.)
            assert set(lost) <= {"heartbeat expired"}, f"the victim was announced lost for {lost}"
            # The lighthouse's own rule is now - last_seen >= timeout; our timestamp of the last
            # heartbeat is taken just after the lighthouse's, hence the small slack.
            assert first_without - last_beat >= HEARTBEAT_TIMEOUT_S - 0.05, (
                f"a quorum without the victim {first_without - last_beat:.2f}s after its last "
                "heartbeat, before the heartbeat expired"
            )
            heal_and_finish(job, 1, exact=True)
        finally:
            job.close()
