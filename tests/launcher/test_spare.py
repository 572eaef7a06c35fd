"""Warm spares (``torchheal/launcher/spare.py``): real processes handed a rank's identity.

A spare must be indistinguishable from a cold start to the script it runs (argv, environment,
working directory, ``sys.path[0]``, ``__main__``, exit status, death by signal, output on the
launcher's pipe), and a spare that is gone must cost nothing but the warm start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from torchheal.launcher.spare import SparePool
from torchheal.launcher.spare_command import parse_python_command, startup_differences
from torchheal.launcher.spare_priority import may_leave_idle
from torchheal.launcher.spare_process import started_warm

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60

# Reports what the interpreter gave it, then exits with the code in argv[1].
REPORT = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
        "group": os.environ.get("GROUP"), "only_spare": os.environ.get("ONLY_SPARE"),
        "warm": os.environ.get("TORCHHEAL_WARM_SPARE"), "stdin": os.readlink("/proc/self/fd/0"),
    }), flush=True)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture(params=[True, False], ids=["forked", "fresh"])
def fork(request: pytest.FixtureRequest) -> bool:
    """How the pool starts its spares: forked from one template that imported once (the
    default on Linux), or each as a fresh interpreter (elsewhere)."""
    return request.param


def _pool(tmp_path: Path, fork: bool, **kw) -> SparePool:
    env = {**os.environ, "ONLY_SPARE": "x"}
    kw.setdefault("preload", ())  # the mechanism, not torch's import time, is under test
    return SparePool([sys.executable, "unused.py"], 1, env=env, cwd=str(tmp_path), fork=fork, **kw)


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "ONLY_SPARE"} | extra


def test_a_spare_runs_the_script_with_the_ranks_argv_env_cwd_and_exit_code(
    tmp_path: Path, fork: bool
) -> None:
    script = tmp_path / "scripts" / "report.py"
    script.parent.mkdir()
    script.write_text(REPORT)
    workdir = tmp_path / "work"
    workdir.mkdir()
    with _pool(tmp_path, fork) as pool:
        assert pool.fill() == 1
        assert pool.wait_ready(TIMEOUT)
        spare_pid = pool.pids[0]
        proc = pool.spawn(
            [sys.executable, str(script), "7", "--lr", "0.1"], _env(GROUP="3"), str(workdir)
        )
        assert started_warm(proc) and proc.pid == spare_pid
        assert pool.pids == []
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 7, out
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {
        "argv": [str(script), "7", "--lr", "0.1"],
        "cwd": str(workdir),
        "path0": str(script.parent),
        "name": "__main__",
        "group": "3",
        "only_spare": None,  # the environment is replaced, not merged
        "warm": "1",
        "stdin": "/dev/null",  # as a cold start's
    }


def test_a_spare_runs_a_module_and_its_failure_reads_like_the_scripts(
    tmp_path: Path, fork: bool
) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os, sys\nprint('in', __name__, sys.argv[1:], os.getcwd(), flush=True)\n"
        "raise RuntimeError('boom from the script')\n"
    )
    with _pool(tmp_path, fork) as pool:
        pool.fill()
        proc = pool.spawn([sys.executable, "-m", "mypkg.train", "a"], _env(), str(tmp_path))
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert started_warm(proc)
    assert proc.returncode == 1, out
    assert f"in __main__ ['a'] {tmp_path}" in out
    assert "RuntimeError: boom from the script" in out
    tb = out[out.index("Traceback") :]
    assert "spare_child" not in tb and "runpy" not in tb, tb  # the script's frames only


def test_sigkill_of_a_taken_spare_kills_the_script(tmp_path: Path, fork: bool) -> None:
    script = tmp_path / "wait.py"
    script.write_text("import os, signal\nprint(os.getpid(), flush=True)\nsignal.pause()\n")
    with _pool(tmp_path, fork) as pool:
        pool.fill()
        proc = pool.spawn([sys.executable, str(script)], _env())
        assert started_warm(proc)
        assert proc.stdout is not None
        # The script runs in that very process: the pid the launcher kills is the script's.
        assert proc.stdout.readline() == f"{proc.pid}\n"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL


def test_a_script_that_kills_itself_with_a_signal_exits_by_that_signal(
    tmp_path: Path, fork: bool
) -> None:
    script = tmp_path / "term.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    with _pool(tmp_path, fork) as pool:
        pool.fill()
        proc = pool.spawn([sys.executable, str(script)], _env())
        assert started_warm(proc)
        assert proc.wait(timeout=TIMEOUT) == -signal.SIGTERM


def _wait_exit(pid: int) -> None:
    """Until ``pid`` has exited (or is gone already: reaped by its parent), bounded."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        readable, _, _ = select.select([fd], [], [], TIMEOUT)
        assert readable, f"process {pid} did not exit"
    finally:
        os.close(fd)


def _one_ready_spare(pool: SparePool) -> int:
    """Fills ``pool`` (of size 1) and waits for its spare; returns the spare's pid."""
    pool.fill()
    assert pool.wait_ready(TIMEOUT)
    (pid,) = pool.pids
    return pid


def _kill_and_wait(*pids: int | None) -> None:
    """SIGKILLs each of ``pids`` in turn, waiting for each to be gone."""
    for pid in pids:
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _wait_exit(pid)


def test_a_spare_killed_before_it_was_taken_falls_back_to_a_cold_start(
    tmp_path: Path, fork: bool, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    with _pool(tmp_path, fork) as pool:
        pid = _one_ready_spare(pool)
        # Forked: the template goes first, or it would fork another spare.
        _kill_and_wait(*([pool.template_pid, pid] if fork else [pid]))
        with caplog.at_level(logging.WARNING, logger="torchheal.launcher.spare"):
            proc = pool.spawn([sys.executable, str(script), "0"], _env(GROUP="1"))
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert not started_warm(proc) and proc.pid != pid
        assert (pool.taken, pool.cold) == (0, 1)
    assert proc.returncode == 0, out
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["group"] == "1" and seen["warm"] is None
    if fork:
        assert f"template exited with -{int(signal.SIGKILL)}" in caplog.text
        # Its status died with the template: the spare is seen gone unused when the pool looks
        # (once the system reaped it), or when the spawn waits for it.
        assert (
            "before it was used" in caplog.text
            or f"warm spare {pid} ended after its template" in caplog.text
        ), caplog.text
    else:
        assert f"exited with -{int(signal.SIGKILL)} before it was used" in caplog.text


def test_a_forked_spare_killed_before_it_was_taken_is_replaced_by_another_fork(
    tmp_path: Path,
) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    with _pool(tmp_path, True) as pool:
        pid = _one_ready_spare(pool)
        _kill_and_wait(pid)
        proc = pool.spawn([sys.executable, str(script), "0"], _env(GROUP="1"))
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert started_warm(proc) and proc.pid != pid
        assert (pool.taken, pool.cold) == (1, 0)
    assert proc.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1])["warm"] == "1"


def test_refills_fork_from_the_template_without_importing_again(tmp_path: Path) -> None:
    imports = tmp_path / "imports"
    (tmp_path / "counted.py").write_text(f"open({str(imports)!r}, 'a').write('x')\n")
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    with _pool(tmp_path, True, preload=["counted"]) as pool:
        pool.fill()
        assert pool.wait_ready(TIMEOUT)
        procs = []
        for group in "123":
            procs.append(pool.spawn([sys.executable, str(script), "0"], _env(GROUP=group)))
            pool.fill()  # the refill: a fork, at once
            assert len(pool.pids) == 1
        outs = [proc.communicate(timeout=TIMEOUT)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], outs
    assert all(map(started_warm, procs)) and len({proc.pid for proc in procs}) == 3
    assert [json.loads(out.strip().splitlines()[-1])["group"] for out in outs] == ["1", "2", "3"]
    assert imports.read_text() == "x"  # once, in the template: no spare imported it again


def test_a_forked_rank_outlives_the_pool_and_its_exit_status_still_arrives(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    script = tmp_path / "waits.py"
    script.write_text(f"import sys\nopen({str(fifo)!r}).read()\nsys.exit(4)\n")
    with _pool(tmp_path, True) as pool:
        pool.fill()
        assert pool.wait_ready(TIMEOUT)
        template = pool.template_pid
        proc = pool.spawn([sys.executable, str(script)], _env())
    assert template is not None and started_warm(proc)
    # The pool closed; the rank runs on, and so does its parent, the template.
    assert proc.poll() is None
    os.kill(template, 0)
    with open(fifo, "w") as release:
        release.write("go")
    assert proc.wait(timeout=TIMEOUT) == 4
    _wait_exit(template)  # its last child ended: the template leaves too


def test_spares_that_keep_dying_turn_the_pool_off(tmp_path: Path, fork: bool) -> None:
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with SparePool(
        [sys.executable, "x.py"],
        1,
        env=env,
        cwd=str(tmp_path),
        preload=["dies_on_import"],
        fork=fork,
    ) as pool:
        for _ in range(3):
            assert pool.fill() == 1
            assert not pool.wait_ready(TIMEOUT)  # it died instead
        assert pool.fill() == 0 and not pool.enabled
        proc = pool.spawn([sys.executable, "-c", "pass"], env)
        assert not started_warm(proc) and proc.wait(timeout=TIMEOUT) == 0


def test_a_rank_whose_start_up_variables_differ_starts_cold(tmp_path: Path, fork: bool) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    with _pool(tmp_path, fork) as pool:
        pool.fill()
        assert pool.wait_ready(TIMEOUT)
        proc = pool.spawn([sys.executable, str(script), "0"], _env(OMP_NUM_THREADS="3"))
        proc.communicate(timeout=TIMEOUT)
        assert not started_warm(proc) and pool.pids  # the spare is kept for the next rank
    assert startup_differences({"OMP_NUM_THREADS": "1", "RANK": "0"}, {"RANK": "1"}) == [
        "OMP_NUM_THREADS"
    ]


def test_which_commands_a_spare_can_run() -> None:
    py = sys.executable
    assert parse_python_command([py, "-u", "-X", "dev", "t.py", "-m", "x"]) is not None
    cmd = parse_python_command([py, "-u", "-X", "dev", "t.py", "-m", "x"])
    assert cmd is not None
    assert (cmd.interpreter, cmd.kind, cmd.target, cmd.args) == (
        (py, "-u", "-X", "dev"),
        "path",
        "t.py",
        ("-m", "x"),
    )
    cmd = parse_python_command(["python3.11", "-mbench.goodput", "--worker"])
    assert cmd is not None and (cmd.kind, cmd.target, cmd.args) == (
        "module",
        "bench.goodput",
        ("--worker",),
    )
    assert parse_python_command([py, "-c", "pass"]).kind == "code"  # type: ignore[union-attr]
    for cold in (["torchrun", "t.py"], [py, "-i", "t.py"], [py], ["bash", "-c", "python t.py"]):
        assert parse_python_command(cold) is None, cold
    for never in ([py, "-c", "pass"], ["torchrun", "t.py"]):  # no spare would ever be used
        assert not SparePool(never, 1, env={}).enabled


# A group's script under `torchheal launch`: a first start reports committed steps until it is
# killed; a restart that began in a warm spare records it and finishes; a cold restart goes on
# like a first start (so the next kill, once a spare exists, is the one that counts). Group 0
# finishes once group 1 was restarted warm.
LAUNCHED = textwrap.dedent(
    """
    import json, os, sys, time
    out = sys.argv[1]
    group, start = os.environ["REPLICA_GROUP_ID"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    def step(n):
        record = {"kind": "step", "group": int(group), "time": time.time(), "step": n,
                  "committed": True}
        print("@torchheal " + json.dumps(record), flush=True)
    if group == "1" and os.environ.get("TORCHHEAL_WARM_SPARE") == "1":
        with open(os.path.join(out, "warm"), "w") as f:
            f.write(f"start {start} pid {os.getpid()} torch {'torch' in sys.modules}")
        print("group 1 started warm", flush=True)
        sys.exit(0)
    n = 0
    deadline = time.time() + 60
    while time.time() < deadline:
        n += 1
        step(n)
        if group == "0" and os.path.exists(os.path.join(out, "warm")):
            sys.exit(0)
        time.sleep(0.1)
    sys.exit(5)
    """
)


def test_launch_restarts_a_killed_group_from_a_warm_spare(tmp_path: Path) -> None:
    script = tmp_path / "group.py"
    script.write_text(LAUNCHED)
    flags = ["--replicas", "2", "--warm-spares", "1", "--kill-every", "2s"]
    flags += ["--restart-delay", "200ms", "--dashboard-port", "0", "--deadline", "100s", "--"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchheal.cli",
            "launch",
            *flags,
            sys.executable,
            str(script),
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-3000:]
    warm = (tmp_path / "warm").read_text()
    # A restart (not the first start), in a process that had torch imported before it began.
    assert re.fullmatch(r"start [1-9]\d* pid \d+ torch True", warm), warm
    assert "[group 1] group 1 started warm" in out
    m = re.search(r"^\[launch\] restarts from a warm spare: (\d+) of (\d+)$", out, re.M)
    assert m and int(m.group(1)) >= 1, out[-3000:]


def test_launch_rejects_a_negative_number_of_spares() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchheal.cli", "launch", "--warm-spares", "-1", "--", "x"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 2 and "--warm-spares" in done.stderr


# Reports every thread's scheduling policy, then exits.
POLICIES = textwrap.dedent(
    """
    import json, os

    def policy(tid):
        try:
            return os.sched_getscheduler(tid)
        except ProcessLookupError:  # a thread that ended since the listing
            return None

    tids = [int(t) for t in os.listdir("/proc/self/task")]
    policies = {policy(t) for t in tids} - {None}
    print(json.dumps(sorted(policies)), flush=True)
    """
)


def _policy(pid: int) -> int:
    return os.sched_getscheduler(pid)


def test_a_spare_preloads_at_idle_priority_and_runs_the_rank_at_normal(
    tmp_path: Path, fork: bool
) -> None:
    (tmp_path / "policies.py").write_text(POLICIES)
    (tmp_path / "threaded.py").write_text(  # a preloaded module that starts a thread
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    )
    with _pool(tmp_path, fork, preload=["threaded"]) as pool:
        pool.fill()
        assert pool.wait_ready(TIMEOUT)
        pid = pool.pids[0]
        if may_leave_idle():
            assert _policy(pid) == os.SCHED_IDLE  # waiting costs the job nothing
        proc = pool.spawn([sys.executable, "policies.py"], _env(), str(tmp_path))
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert started_warm(proc) and proc.returncode == 0, out
    # Every thread, the preload's own included, is back at normal priority.
    assert json.loads(out.strip().splitlines()[-1]) == [os.SCHED_OTHER]


def test_a_spare_taken_while_preloading_finishes_at_normal_priority(tmp_path: Path) -> None:
    """A spare started fresh is handed the rank while it still imports."""
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    # A preload that cannot finish until the test lets it: the hand-over comes first.
    (tmp_path / "blocked.py").write_text(f"open({str(fifo)!r}).read()\n")
    (tmp_path / "policies.py").write_text(POLICIES)
    with _pool(tmp_path, False, preload=["blocked"]) as pool:
        pool.fill()
        pid = pool.pids[0]
        if may_leave_idle():
            _wait_for(lambda: _policy(pid) == os.SCHED_IDLE, "the spare going idle")
        proc = pool.spawn([sys.executable, "policies.py"], _env(), str(tmp_path))
        try:
            # Still preloading, and already at normal priority (it would starve at idle on a
            # busy machine, with its rank waiting for it).
            _wait_for(lambda: _policy(pid) == os.SCHED_OTHER, "normal priority at the hand-over")
            assert proc.poll() is None
            with open(fifo, "w") as release:
                release.write("go")
            out, _ = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:  # a failed check leaves it blocked in its preload
                proc.kill()
                proc.wait()
    assert started_warm(proc) and proc.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1]) == [os.SCHED_OTHER]


def _wait_for(predicate, what: str) -> None:
    import time

    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        select.select([], [], [], 0.01)


def _spawn_held(
    pool: SparePool,
    argv: list[str],
    env: dict[str, str],
    workdir: Path,
    meanwhile: Callable[[Callable[[], bool]], None],
) -> subprocess.Popen[str]:
    """``pool.spawn`` on a thread while the template is held in its imports by the fifo
    ``workdir/release``; ``meanwhile`` runs before the release, with a function telling whether
    the spawn still waits. Returns the rank."""
    spawned: list[subprocess.Popen[str]] = []
    spawner = threading.Thread(target=lambda: spawned.append(pool.spawn(argv, env, str(workdir))))
    spawner.start()
    try:
        meanwhile(lambda: spawner.is_alive() and not spawned)
    finally:
        with open(workdir / "release", "w") as release:
            release.write("go")
        spawner.join(TIMEOUT)
    (proc,) = spawned
    return proc


def test_a_rank_that_comes_while_the_template_imports_waits_for_it_at_normal_priority(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    (tmp_path / "blocked.py").write_text(f"open({str(fifo)!r}).read()\n")
    (tmp_path / "policies.py").write_text(POLICIES)
    with _pool(tmp_path, True, preload=["blocked"]) as pool:
        pool.fill()
        pid = pool.template_pid
        assert pid is not None
        if may_leave_idle():
            _wait_for(lambda: _policy(pid) == os.SCHED_IDLE, "the template going idle")

        def meanwhile(waiting: Callable[[], bool]) -> None:
            # The rank waits for the template, which finishes its imports at normal priority.
            _wait_for(lambda: _policy(pid) == os.SCHED_OTHER, "normal priority for the rank")
            assert waiting()

        proc = _spawn_held(pool, [sys.executable, "policies.py"], _env(), tmp_path, meanwhile)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert started_warm(proc) and proc.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1]) == [os.SCHED_OTHER]


def test_a_preload_that_starts_a_thread_makes_the_spares_start_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A fork copies only the forking thread: the rank would run without the module's thread.
    (tmp_path / "flushing.py").write_text(
        "import threading\n"
        "threading.Thread(target=threading.Event().wait, name='flusher', daemon=True).start()\n"
    )
    (tmp_path / "threads.py").write_text(
        "import json, threading\n"
        "print(json.dumps(sorted(t.name for t in threading.enumerate())), flush=True)\n"
    )
    with caplog.at_level(logging.WARNING, logger="torchheal.launcher.spare"):
        with _pool(tmp_path, True, preload=["flushing"]) as pool:
            pool.fill()
            assert pool.wait_ready(TIMEOUT)
            assert pool.template_pid is None and len(pool.pids) == 1
            proc = pool.spawn([sys.executable, "threads.py"], _env(), str(tmp_path))
            out, _ = proc.communicate(timeout=TIMEOUT)
    assert started_warm(proc) and proc.returncode == 0, out
    assert "flusher" in json.loads(out.strip().splitlines()[-1])
    assert "warm spares start fresh, not forked" in caplog.text and "flusher" in caplog.text


def test_closing_the_pool_ends_a_template_still_importing(tmp_path: Path) -> None:
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    (tmp_path / "stuck.py").write_text(f"open({str(fifo)!r}).read()\n")  # never released
    with _pool(tmp_path, True, preload=["stuck"]) as pool:
        pool.fill()
        template = pool.template_pid
        assert template is not None
    _wait_exit(template)  # not left behind, blocked in its imports


def test_a_rank_that_comes_before_the_template_went_idle_still_raises_it(tmp_path: Path) -> None:
    # The template is held in interpreter start-up (sitecustomize), before it goes idle: the
    # rank's hurry comes first, and must not be undone when the template then goes idle.
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"open({str(fifo)!r}).read()\n")
    (tmp_path / "report.py").write_text(REPORT)
    env = {**os.environ, "PYTHONPATH": str(site)}
    with SparePool(
        [sys.executable, "x.py"], 1, env=env, cwd=str(tmp_path), preload=(), fork=True
    ) as pool:
        pool.fill()
        template = pool.template_pid
        assert template is not None
        proc = _spawn_held(
            pool,
            [sys.executable, "report.py", "0"],
            env,
            tmp_path,
            lambda waiting: _wait_for(lambda: not waiting() or _hurried(pool), "the rank's hurry"),
        )
        out, _ = proc.communicate(timeout=TIMEOUT)
        policy = _policy(template)
    assert started_warm(proc) and proc.returncode == 0, out
    assert policy == os.SCHED_OTHER  # not left idle (it would starve on a busy machine)


def _hurried(pool: SparePool) -> bool:
    """The pool has asked its template to hurry: a byte waits in the template's pipe (the
    order under test is internal to the pool, so is what shows it)."""
    import fcntl
    import termios

    template = pool._template
    if template is None or template._hurry_w < 0:
        return False
    pending = bytearray(4)
    fcntl.ioctl(template._hurry_w, termios.FIONREAD, pending)
    return int.from_bytes(pending, sys.byteorder) > 0
