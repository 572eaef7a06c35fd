"""A restart that waits for a warm spare still importing does not stop the launcher's loop.

The launcher used to wait for the spare template inside ``spawn``, for up to two minutes: its
loop read no output and checked nothing meanwhile. A job that finished during that wait then
restarted the killed group anyway, with no peer left to heal from: it trained alone from step
0 and ended with other weights (seen in a demo run with the template starved at idle priority).
Now the loop polls ``SparePool.preparing`` and goes on: a job that ends meanwhile restarts
nobody.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from torchheal.launcher import KillPlan, Launcher
from torchheal.launcher.events import Event
from torchheal.launcher.spare_fork import supported

pytestmark = pytest.mark.skipif(not supported(), reason="forked spares are Linux only")

# Each group waits for a file the test writes from the launcher's callbacks (no timing): group 1
# reports step 5 (the kill) once group 0 trains, so the pool has started its template; group 0
# finishes once group 1's restart is scheduled, so the job ends while the restart waits.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from torchheal.launcher.events import emit
    group, workdir = int(os.environ["REPLICA_GROUP_ID"]), sys.argv[1]

    def wait_for(name):
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(workdir, name)):
            assert time.time() < deadline, f"never saw {name}"
            time.sleep(0.05)

    emit("step", group, step=1, committed=True)
    if group == 1:
        wait_for("group-0-trains")
        emit("step", group, step=5, committed=True)
        time.sleep(120)  # the launcher kills it; a restart that ran alone would sleep here too
    wait_for("restart-scheduled")
    emit("done", group, step=6, digest="abc")
    """
)

# A preload that keeps the spare template importing until the test lets it go (or 30 s pass).
BLOCKER = textwrap.dedent(
    """
    import os, time
    _release = os.path.join(os.environ["BLOCKER_DIR"], "release")
    _deadline = time.time() + 30
    while not os.path.exists(_release) and time.time() < _deadline:
        time.sleep(0.05)
    """
)


def test_a_job_that_ends_while_the_restart_waits_for_a_spare_restarts_nobody(
    tmp_path: Path,
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (tmp_path / "blocker.py").write_text(BLOCKER)
    kills: list[int] = []

    def on_event(e: Event) -> None:
        if e.kind == "step" and e.group == 0:
            (tmp_path / "group-0-trains").touch()

    def on_restart(group: int, code: int) -> None:
        (tmp_path / "restart-scheduled").touch()

    launcher = Launcher(
        [sys.executable, str(script), str(tmp_path)],
        replicas=2,
        lighthouse_addr="http://lighthouse.invalid:1",
        kill_plan=KillPlan(at_step=5, victims=(1,), max_kills=1),
        restart_delay_s=0.0,
        deadline_s=60,
        on_event=on_event,
        on_kill=lambda group, reason: kills.append(group),
        on_restart=on_restart,
        env={"PYTHONPATH": str(tmp_path), "BLOCKER_DIR": str(tmp_path)},
        startup_grace_s=0.0,
        warm_spares=1,
        spare_preload=("blocker",),
    )
    try:
        result = launcher.run()
    finally:
        (tmp_path / "release").touch()
    assert kills == [1]
    assert not result.timed_out
    victim = result.groups[1]
    assert len(victim.starts) == 1, "the killed group was restarted after the job had finished"
    assert victim.stopped
    assert result.groups[0].done
