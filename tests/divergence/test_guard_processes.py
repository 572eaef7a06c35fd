"""The divergence guard catches what it claims, with real processes (issue 41).

Each case runs replica groups as separate processes (``tests/divergence/worker.py``) against an
in-process lighthouse at ``min_replicas=1``, and reads back what each group wrote: a digest of
its parameters and momentum after every commit, and the guard's counters at its end. Each is
red without the guard (``divergence_check_interval=0``): the fault then goes unnoticed.

* (b) a ``load_state_dict`` that skips the optimizer state on a heal: detected at the heal;
* (c) one bit flipped in one parameter of one of three groups: under ``repair`` the group heals
  from the majority and every group ends bit-identical; under ``stop`` every group stops with
  an error naming the step;
* (d) a scheduler outside the state dict that a heal leaves behind: detected once registered
  with ``Manager.register_fingerprint``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.interop.helpers import loopback
from torchheal.coordination import LighthouseServer

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 120.0


def run_groups(
    tmp: Path,
    per_group: list[list[str]],
    steps: int,
    until: Callable[[list[list[dict]]], bool] | None = None,
    lighthouse_cls: Any = LighthouseServer,
) -> tuple[list, list[int]]:
    """Runs one process per group; returns each group's records and exit codes.

    ``until``: the groups train on (``steps`` is not reached) until it holds of the records
    written so far; then every process is ended (exit code -9): the groups need not reach a
    common last step to leave cleanly. ``lighthouse_cls``: the
    reference's works too (the guard needs nothing of the lighthouse).
    """
    lighthouse = lighthouse_cls(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=5000,
    )
    addr = loopback(lighthouse)
    ready = tmp / "ready"
    ready.mkdir()
    procs = []
    try:
        for g, extra in enumerate(per_group):
            cmd = [
                *(sys.executable, "-m", "tests.divergence.worker", "--group", str(g)),
                *("--lighthouse", addr, "--out", str(tmp / f"g{g}"), "--steps", str(steps)),
                *extra,
            ]
            procs.append(
                subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
        codes = []
        deadline = time.monotonic() + DEADLINE_S
        errors = []
        while until is not None and not until([_records(tmp / f"g{g}") for g in range(len(procs))]):
            assert time.monotonic() < deadline, "the groups did not get there in time"
            for g, proc in enumerate(procs):
                if proc.poll() is not None:
                    err = proc.communicate()[1].decode(errors="replace")[-4000:]
                    raise AssertionError(f"group {g} exited {proc.returncode}:\n{err}")
            time.sleep(0.1)  # polling files the workers write
        if until is not None:
            for proc in procs:
                proc.kill()
        for g, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)  # its stacks, for the message
                time.sleep(1.0)  # (the dump is written by the worker itself)
                proc.kill()
                _, err = proc.communicate()
                stuck = err.decode(errors="replace")[-20000:]
                raise AssertionError(f"group {g} did not finish in time:\n{stuck}") from None
            codes.append(proc.returncode)
            errors.append(err.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()
    records = [
        {"records": _records(tmp / f"g{g}"), "stderr": errors[g]} for g in range(len(per_group))
    ]
    return records, codes


def _records(path: Path) -> list[dict]:
    # Only whole lines: the last one may be half written.
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


def healed_and_committed(joiner: int) -> Callable[[list[list[dict]]], bool]:
    """The joining group committed three times (its heal's step, the step compared after it,
    and the next, whose vote takes that comparison's verdict)."""
    return lambda records: sum("digest" in r for r in records[joiner]) >= 3


def digests(group: dict) -> dict[int, str]:
    return {r["step"]: r["digest"] for r in group["records"] if "digest" in r}


def done(group: dict) -> dict:
    """The group's last counters (its final record, or its last commit's)."""
    ends = [r for r in group["records"] if "checks" in r]
    assert ends, f"the group wrote no counters: {group['stderr'][-3000:]}"
    return ends[-1]


def together(g: int, groups: int, tmp: Path) -> list[str]:
    return ["--ready-dir", str(tmp / "ready"), "--groups", str(groups)]


def flip_run(
    tmp: Path, interval: int, policy: str, steps: int, flip: int, **kwargs: Any
) -> tuple[list, list]:
    base = ["--interval", str(interval), "--policy", policy]
    runs = [base + together(g, 3, tmp) for g in range(3)]
    runs[2] += ["--flip-at", str(flip)]
    groups, codes = run_groups(tmp, runs, steps, **kwargs)
    assert any(r.get("event") == "flip" for r in groups[2]["records"]), "no bit was flipped"
    return groups, codes


def test_a_flipped_bit_is_repaired_from_the_majority(tmp_path: Path, **kwargs: Any) -> None:
    # Group 2 flips one bit of one weight after committing step 4. The guard (every step)
    # compares step 4 and finds it at step 5's vote; group 2 votes no, heals from the majority
    # at the next quorum, and every group ends with the same weights.
    steps = 12
    groups, codes = flip_run(tmp_path, 1, "repair", steps, flip=4, **kwargs)
    assert codes == [0, 0, 0], [g["stderr"][-2000:] for g in groups]
    per = [digests(g) for g in groups]
    check = steps - 2
    assert all(check in d for d in per), "a group did not commit the compared step"
    assert len({d[check] for d in per}) == 1, f"groups differ at step {check}"
    assert done(groups[2])["mismatches"] >= 1
    assert done(groups[0])["mismatches"] >= 1  # the majority reports it too
    assert "divergence at step 4" in groups[2]["stderr"]
    # The key and the one tensor the bit was flipped in are named.
    assert "g2" in groups[0]["stderr"] and "differs in default/model" in groups[0]["stderr"]
    assert "(tensors default/model/0.weight)" in groups[0]["stderr"]
    assert done(groups[2])["last_verified"] >= check  # compared and matched after the repair


def test_without_the_guard_a_flipped_bit_stays(tmp_path: Path) -> None:
    # The control: the same run with the guard off ends with group 2 different for good.
    steps = 12
    groups, codes = flip_run(tmp_path, 0, "repair", steps, flip=4)
    assert codes == [0, 0, 0], [g["stderr"][-2000:] for g in groups]
    per = [digests(g) for g in groups]
    check = steps - 2
    assert per[0][check] == per[1][check] != per[2][check]
    assert done(groups[2])["checks"] == 0


def test_a_flipped_bit_stops_every_group_under_stop(tmp_path: Path) -> None:
    flip = 4
    groups, codes = flip_run(tmp_path, 1, "stop", 12, flip)
    assert all(code != 0 for code in codes), codes
    for g in groups:
        assert "DivergenceError" in g["stderr"], g["stderr"][-2000:]
        assert f"divergence at step {flip}" in g["stderr"]
        assert "g2" in g["stderr"]  # the odd group is named
        assert max(digests(g)) <= flip + 1


def test_a_heal_that_skips_the_optimizer_state_is_detected(tmp_path: Path) -> None:
    # Group 2 joins a running job at step 6 and heals; its load_state_dict drops the
    # optimizer's momentum. Its state differs from the sources' from the heal on: reported at
    # the first step after the heal (due after every heal, whatever the interval), naming the
    # optimizer. A loader this broken cannot be repaired by healing again; it is reported.
    base = ["--interval", "5", "--policy", "warn"]
    runs = [base + together(g, 2, tmp_path) for g in range(2)]
    runs.append(
        [*base, "--join-at", "6", "--peer-out", str(tmp_path / "g0"), "--skip-optim-on-load"]
    )
    groups, _ = run_groups(tmp_path, runs, 100_000, until=healed_and_committed(2))
    assert done(groups[2])["mismatches"] >= 1, "the bad heal went unnoticed"
    assert "default/optim" in groups[2]["stderr"].split("differs in", 1)[1].split(";")[0]


def test_a_registered_scheduler_left_behind_by_a_heal_is_detected(tmp_path: Path) -> None:
    # The scheduler is not in the state dict: a group that joins and heals keeps its own
    # (fresh) scheduler, while model and optimizer are the sources'. Registered with
    # register_fingerprint, the difference is reported at the heal.
    base = ["--interval", "100", "--policy", "warn", "--scheduler", "--compare-scheduler"]
    runs = [base + together(0, 1, tmp_path)]
    runs.append([*base, "--join-at", "5", "--peer-out", str(tmp_path / "g0")])
    groups, _ = run_groups(tmp_path, runs, 100_000, until=healed_and_committed(1))
    assert done(groups[1])["checks"] >= 1
    assert done(groups[1])["mismatches"] >= 1, "the scheduler's difference went unnoticed"
    assert "compared/scheduler" in groups[1]["stderr"]
