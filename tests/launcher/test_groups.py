"""Replica groups of K ranks under the local launcher: real processes, stores, kills, restarts."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from torchheal.launcher import KillPlan, Launcher
from torchheal.launcher.proctree import descendants, kill_trees

# Every rank checks the variables torchrun would give it and uses the group's store: rank 0
# writes a key, every rank reads it (so the store the launcher hosts is real and shared).
TORCHRUN_LIKE = textwrap.dedent(
    """
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    assert env["LOCAL_RANK"] == env["RANK"], env
    assert env["LOCAL_WORLD_SIZE"] == env["WORLD_SIZE"] == "2", env
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHHEAL_LIGHTHOUSE"] == "http://lighthouse.invalid:1"
    assert env["NUM_REPLICA_GROUPS"] == "2"
    group = env["REPLICA_GROUP_ID"]
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=30))
    if rank == 0:
        store.set("hello", f"group {group}")
    assert store.get("hello").decode() == f"group {group}"
    with open(os.path.join(sys.argv[1], f"g{group}r{rank}"), "w") as f:
        f.write(env["MASTER_PORT"])
    """
)


def test_each_rank_gets_torchruns_variables_and_its_groups_store(tmp_path: Path) -> None:
    launcher = Launcher(
        [sys.executable, "-c", TORCHRUN_LIKE, str(tmp_path)],
        replicas=2,
        nproc_per_replica=2,
        lighthouse_addr="http://lighthouse.invalid:1",
        deadline_s=60,
    )
    result = launcher.run()
    assert result.error is None and not result.timed_out
    for g in (0, 1):
        assert result.groups[g].exit_codes == [0] and result.groups[g].done
        ports = {(tmp_path / f"g{g}r{r}").read_text() for r in (0, 1)}
        assert len(ports) == 1, "both ranks of a group share one store"
    assert (tmp_path / "g0r0").read_text() != (tmp_path / "g1r0").read_text()


# First start: rank 1 starts a grandchild in a session of its own (as torchrun starts its
# workers), then dies; rank 0 would sleep on. The launcher must end rank 0 and the grandchild,
# and start the group again (on a new store); the second start exits cleanly.
DIES_WITH_A_DETACHED_CHILD = textwrap.dedent(
    """
    import os, subprocess, sys, time
    d, rank = sys.argv[1], os.environ["RANK"]
    first = not os.path.exists(os.path.join(d, "second-start"))
    with open(os.path.join(d, f"port-{rank}-{'a' if first else 'b'}"), "w") as f:
        f.write(os.environ["MASTER_PORT"])
    if not first:
        sys.exit(0)
    if rank == "1":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 start_new_session=True)
        with open(os.path.join(d, "grandchild"), "w") as f:
            f.write(str(child.pid))
        open(os.path.join(d, "second-start"), "w").close()
        print("rank 1 giving up", flush=True)
        sys.exit(3)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie awaiting its reaper is dead too.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_a_dead_rank_ends_its_whole_group_and_the_group_restarts(tmp_path: Path) -> None:
    restarts: list[tuple[int, int]] = []
    launcher = Launcher(
        [sys.executable, "-c", DIES_WITH_A_DETACHED_CHILD, str(tmp_path)],
        replicas=1,
        nproc_per_replica=2,
        lighthouse_addr="http://x:1",
        restart_delay_s=0.1,
        deadline_s=60,
        on_restart=lambda g, code: restarts.append((g, code)),
    )
    result = launcher.run()
    assert result.error is None and not result.timed_out
    g = result.groups[0]
    assert restarts == [(0, 3)]
    assert g.exit_codes == [3, 0] and g.crashes == 1 and len(g.starts) == 2
    # A fresh store (port) per start: the restarted group must not see the old one's keys.
    assert (tmp_path / "port-1-a").read_text() != (tmp_path / "port-1-b").read_text()
    grandchild = int((tmp_path / "grandchild").read_text())
    deadline = time.time() + 10
    while _alive(grandchild) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the detached grandchild of the dead group was left running"


def test_a_group_dying_before_its_first_step_stops_the_launch_with_its_output() -> None:
    command = [
        sys.executable,
        "-c",
        "import os; print('reading config', flush=True); os.environ['NOT_THERE']",
    ]
    launcher = Launcher(
        command,
        replicas=2,
        lighthouse_addr="http://x:1",
        restart_delay_s=0.05,
        deadline_s=60,
        max_startup_failures=3,
    )
    result = launcher.run()
    assert not result.timed_out
    assert result.error is not None
    assert "died 3 times in a row before its first step (last: exit code 1)" in result.error
    assert "reading config" in result.error and "KeyError: 'NOT_THERE'" in result.error
    failed = [g for g in result.groups.values() if g.startup_failures == 3]
    assert failed and len(failed[0].starts) == 3
    for g in result.groups.values():  # nothing is left running
        assert g.proc is not None and g.proc.poll() is not None


# Commits a step (as the event protocol says), then dies; five times; the sixth start finishes.
STEPS_THEN_DIES = textwrap.dedent(
    """
    import os, sys
    from torchheal.launcher.events import emit
    marker = os.path.join(sys.argv[1], "starts")
    with open(marker, "a") as f:
        f.write("x")
    starts = len(open(marker).read())
    emit("step", 0, step=starts, committed=True)
    sys.exit(0 if starts == 6 else 1)
    """
)


def test_a_group_that_commits_before_dying_is_restarted_as_often_as_it_takes(
    tmp_path: Path,
) -> None:
    launcher = Launcher(
        [sys.executable, "-c", STEPS_THEN_DIES, str(tmp_path)],
        replicas=1,
        lighthouse_addr="http://x:1",
        restart_delay_s=0.05,
        deadline_s=60,
        max_startup_failures=2,
    )
    result = launcher.run()
    assert result.error is None, result.error
    assert result.groups[0].exit_codes == [1, 1, 1, 1, 1, 0]


def test_the_lighthouse_status_tells_a_start_that_committed(tmp_path: Path) -> None:
    """No events: progress comes from the status (a member at a higher step than it joined
    with, matched by the start's store address)."""
    script = textwrap.dedent(
        """
        import os, sys, time
        d = sys.argv[1]
        n = len(os.listdir(d))
        open(os.path.join(d, f"port-{n}-{os.environ['MASTER_PORT']}"), "w").close()
        time.sleep(1.5)
        sys.exit(0 if n == 3 else 1)
        """
    )
    seen: list[dict] = []

    def status() -> dict:
        # What the dashboard reports: every running start is in the quorum, one step further
        # at each look.
        members = [
            {"store_address": f"127.0.0.1:{p.name.rsplit('-', 1)[1]}", "step": len(seen)}
            for p in sorted(tmp_path.iterdir())
        ]
        seen.append({})
        return {"quorum": {"id": 1, "members": members}}

    launcher = Launcher(
        [sys.executable, "-c", script, str(tmp_path)],
        replicas=1,
        lighthouse_addr="http://x:1",
        restart_delay_s=0.05,
        deadline_s=60,
        max_startup_failures=1,
        status=status,
        status_interval_s=0.1,
    )
    result = launcher.run()
    assert result.error is None, result.error
    assert result.groups[0].exit_codes == [1, 1, 1, 0]


def test_kill_trees_reaches_processes_in_other_sessions(tmp_path: Path) -> None:
    import subprocess

    pidfile = tmp_path / "pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
            " start_new_session=True)\n"
            f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
            "time.sleep(120)\n",
        ]
    )
    deadline = time.time() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.time() < deadline and parent.poll() is None
        time.sleep(0.02)
    child = int(pidfile.read_text())
    assert child in descendants([parent.pid])
    killed = kill_trees([parent.pid])
    assert {parent.pid, child} <= killed
    assert parent.wait(timeout=10) == -9
    deadline = time.time() + 10
    while _alive(child) and time.time() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


def test_once_a_group_finished_the_dead_are_not_restarted_nor_killed() -> None:
    script = textwrap.dedent(
        """
        import os, sys, time
        if os.environ["REPLICA_GROUP_ID"] == "0":
            sys.exit(0)  # finishes its work at once
        time.sleep(2.0)
        sys.exit(5)  # dies after the job's work is done
        """
    )
    kills: list[int] = []
    launcher = Launcher(
        [sys.executable, "-c", script],
        replicas=2,
        lighthouse_addr="http://x:1",
        kill_plan=KillPlan(every_s=4.0, victims=(1,)),
        restart_delay_s=0.05,
        deadline_s=60,
        on_kill=lambda g, reason: kills.append(g),
    )
    result = launcher.run()
    assert result.error is None and not result.timed_out
    assert result.groups[0].done and result.groups[0].exit_codes == [0]
    g = result.groups[1]
    assert g.stopped and not g.done and g.exit_codes == [5] and len(g.starts) == 1
    # Restarted, it would have been killed at 4 s; the timer fired into a finished job.
    assert kills == []


# Group 1's first start takes a second before its first commit (as importing torch and healing
# do), then trains until killed; its restart ends the job. Group 0 trains until then.
SLOW_FIRST_STEP = textwrap.dedent(
    """
    import os, sys, time
    from torchheal.launcher.events import emit
    out, group = sys.argv[1], os.environ["REPLICA_GROUP_ID"]
    finished = os.path.join(out, "finished")
    if group == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        open(finished, "w").close()
        sys.exit(0)
    if group == "1":
        time.sleep(1.0)
        with open(os.path.join(out, "first_step"), "w") as f:
            f.write(repr(time.time()))
    n = 0
    while not os.path.exists(finished):
        n += 1
        emit("step", 0, step=n, committed=True)
        time.sleep(0.05)
    """
)


def test_a_timer_kill_waits_for_its_victims_first_commit(tmp_path: Path) -> None:
    kills: list[tuple[int, float]] = []
    launcher = Launcher(
        [sys.executable, "-c", SLOW_FIRST_STEP, str(tmp_path)],
        replicas=2,
        lighthouse_addr="http://x:1",
        kill_plan=KillPlan(every_s=0.3, victims=(1,)),
        restart_delay_s=0.05,
        deadline_s=60,
        on_kill=lambda g, reason: kills.append((g, time.time())),
    )
    result = launcher.run()
    assert result.error is None and not result.timed_out, result.error
    # Due at 0.3 s, the kill waited for the commit that came at ~1 s; the restart then finished.
    assert (tmp_path / "first_step").exists(), kills
    first_step = float((tmp_path / "first_step").read_text())
    assert [g for g, _ in kills] == [1] and kills[0][1] >= first_step
    assert result.groups[1].exit_codes[-1] == 0 and len(result.groups[1].starts) == 2


def test_launcher_rejects_bad_group_sizes() -> None:
    with pytest.raises(ValueError, match="nproc_per_replica"):
        Launcher(["x"], replicas=1, lighthouse_addr="http://x:1", nproc_per_replica=0)
    with pytest.raises(ValueError, match="max_startup_failures"):
        Launcher(["x"], replicas=1, lighthouse_addr="http://x:1", max_startup_failures=0)


def test_ending_a_start_spares_another_jobs_start_of_the_same_name() -> None:
    # Two launchers on one machine that name their jobs alike (the chaos bench names its runs
    # by seed; two CI runs of it once shared a host) hold starts with the same run id, group and
    # incarnation. Ending one must not end the other's ranks, which the search by marker finds.
    import queue

    from torchheal.launcher.group import GroupStart

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    lines: queue.Queue = queue.Queue()
    starts = [
        GroupStart(
            group=1,
            incarnation=1,
            command=sleeper,
            nproc=2,
            replicas=2,
            lighthouse="http://x:1",
            base_env=dict(os.environ),
            lines=lines,
            run_id="same-name",
        )
        for _ in range(2)
    ]
    mine, theirs = starts
    try:
        assert mine.marker != theirs.marker
        mine.kill()
        mine.reap(timeout=30)
        assert mine.exit_codes == {0: -9, 1: -9}
        assert theirs.running() == [0, 1], "the other job's ranks were killed too"
    finally:
        for start in starts:
            start.kill()
            start.reap(timeout=30)
            start.close()
