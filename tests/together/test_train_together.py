"""Replica groups train together at min_replicas=1 and the reference's 100 ms join timeout (issue 8).

Three replica groups, each a real process with its own TCPStore, against a real lighthouse at the
reference's defaults (``min_replicas=1``, join timeout 100 ms, tick 100 ms, heartbeat timeout 5 s)
and ``Manager(min_replica_size=1)``. Nothing fails. Before the fix both scenarios below made the
groups take turns: almost every step committed without one group, which healed instead.

* ``long_steps``: steps of ~250 ms (longer than the join timeout) and one group late once. It is
  left out of one round; the left-out request then started the next round's straggler window, so
  that round went out without the last group back, and so on forever.
* ``slow_heal``: the third group joins a running job and heals; its load takes 250 ms, so it is
  back 250 ms after the others: it was dropped, healed again in the next round, and was late
  again. (Two groups alone cannot drop each other: one of two is no majority.)

The pure rules are pinned by ``tests/coordination/scenarios/08_*`` and ``09_*``; this test shows
the whole system (manager timing included) keeps the groups together.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torchheal.coordination import LighthouseServer

ROOT = Path(__file__).resolve().parents[2]
GROUPS = 3
# Job steps to watch once every group has committed and the injected late step is over.
STEPS_TO_JUDGE = 16
DEADLINE_S = 150.0

CASES = {
    "long_steps": {0: [], 1: [], 2: ["--late-at-step", "6", "--late-s", "0.4"]},
    "slow_heal": {g: ["--load-sleep", "0.25"] for g in range(GROUPS)},
}
STEP_SLEEP = {"long_steps": "0.25", "slow_heal": "0.4"}
# Group 2 of slow_heal starts once the others have committed this step (a late joiner).
JOIN_AT_STEP = {"long_steps": 0, "slow_heal": 3}
LATE_STEP = 6


def _pump(proc: subprocess.Popen, out: queue.Queue) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            out.put(json.loads(line))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_groups_train_together(case: str, tmp_path: Path) -> None:
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=5000,
    )
    addr = f"http://127.0.0.1:{lighthouse.port()}"
    stop_file = tmp_path / "stop"
    events_q: queue.Queue = queue.Queue()
    events: list[dict] = []
    procs: list[subprocess.Popen] = []

    def start(g: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tests.together.worker",
            "--group",
            str(g),
            "--lighthouse",
            addr,
            "--stop-file",
            str(stop_file),
            "--step-sleep",
            STEP_SLEEP[case],
            *CASES[case][g],
        ]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        procs.append(proc)
        threading.Thread(target=_pump, args=(proc, events_q), daemon=True).start()

    try:
        for g in range(GROUPS - 1):
            start(g)
        if not JOIN_AT_STEP[case]:
            start(GROUPS - 1)

        # Watch until every group has committed, the late step is over, and enough job steps
        # followed; then stop the groups.
        judge_from: int | None = None
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                events.append(events_q.get(timeout=1.0))
            except queue.Empty:
                assert all(p.poll() is None for p in procs), "a group exited early"
                continue
            commits = [e for e in events if e["after"] > e["before"]]
            top = max((e["after"] for e in commits), default=0)
            if len(procs) < GROUPS and top >= JOIN_AT_STEP[case]:
                start(GROUPS - 1)
            if judge_from is None:
                if {e["group"] for e in commits} == set(range(GROUPS)) and top > LATE_STEP + 2:
                    judge_from = top
            elif top >= judge_from + STEPS_TO_JUDGE:
                break
        stop_file.touch()
        for proc in procs:
            proc.wait(timeout=60)
            assert proc.returncode == 0, f"a group exited with {proc.returncode}"
    finally:
        stop_file.touch()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()

    assert judge_from is not None, f"the groups never all committed past step {LATE_STEP + 2}"
    window = [
        e
        for e in events
        if e["after"] > e["before"] and judge_from < e["after"] <= judge_from + STEPS_TO_JUDGE
    ]
    full = [e for e in window if e["participants"] == GROUPS]
    summary = (
        f"{len(full)}/{len(window)} commits with all {GROUPS} groups over steps "
        f"{judge_from + 1}..{judge_from + STEPS_TO_JUDGE}"
    )
    assert len(window) >= STEPS_TO_JUDGE, f"too few commits to judge: {summary}"
    assert len(full) >= 0.9 * len(window), f"groups took turns: {summary}"
