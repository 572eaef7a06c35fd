"""A group busy right after a commit its peers failed ends with the same weights (issue 40, bug 1).

Three or four replica groups, each a real process, at the reference's defaults (``min_replicas=1``,
join timeout and tick 100 ms, heartbeat timeout 5 s). In step 5 some groups report an error of
their own, so they vote no, while the others' collectives completed and they commit; one
committing group is then busy (an eval, a checkpoint save) for longer than a step, or than the
heartbeat timeout, before it asks again. The lighthouse must not let the others redo step 5
without it (they would commit step 5 a second time with other contents, and, at an equal step
when it came back, nobody would heal): they wait for it and heal from it. Every group records a
digest of its parameters and momentum after each commit; at every step two groups committed,
the digests must be equal.

The rule is pinned by ``tests/coordination/scenarios/16_no_redo_of_a_live_commit.txt``.
``tests/divergence/test_late_committer_guard.py`` runs the case on the reference's lighthouse,
which still has the old rule, with and without the divergence guard.
``python -m tests.commit.test_late_committer --runs 10`` runs the whole matrix of the issue.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.interop.helpers import loopback
from torchheal.coordination import LighthouseServer

ROOT = Path(__file__).resolve().parents[2]
FAIL_AT = 5
STEPS = 12
DEADLINE_S = 120.0


def run_case(
    tmp: Path,
    groups: int,
    failing: str,
    busy_s: float,
    impl: str = "torchheal",
    frozen: bool = False,
    step_s: float = 0.05,
    pause_after_fail: float = 0.0,
    lighthouse_cls: Any = LighthouseServer,
    level: bool = False,
    worker_args: Sequence[str] = (),
    records: dict[int, list[dict]] | None = None,
) -> dict[int, dict[int, str]]:
    """Run one job; return each group's digest at each step it committed.

    ``failing``: "one" (the last group fails step 5) or "all_but_one" (every group but the
    busy group 0 does). ``lighthouse_cls``: the reference's runs the case under its quorum
    rule. ``worker_args``: passed to every group (the guard's ``--interval``, ``--policy``).
    ``level``: the busy group and the failing ones ask for their next quorum together, after
    the busy time and the failing groups' next commit (``late_worker``'s ``--level-dir``).
    ``records``: filled with each group's commit records (digest and guard counters), in order.
    """
    lighthouse = lighthouse_cls(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=5000,
    )
    addr = loopback(lighthouse)
    fails = {groups - 1} if failing == "one" else set(range(1, groups))
    ready = tmp / "ready"
    ready.mkdir()
    (tmp / "level").mkdir()
    stop = tmp / "stop"
    for g in range(groups):
        (tmp / f"g{g}").touch()
    procs = []
    try:
        for g in range(groups):
            cmd = [
                *(sys.executable, "-m", "tests.commit.late_worker", "--group", str(g)),
                *("--groups", str(groups), "--ready-dir", str(ready)),
                *("--lighthouse", addr, "--stop-file", str(stop), "--out", str(tmp / f"g{g}")),
                *("--impl", impl, "--step-s", str(step_s)),
                *worker_args,
            ]
            if g in fails:
                cmd += ["--fail-at", str(FAIL_AT), "--pause-after-fail", str(pause_after_fail)]
            if level and (g in fails or g == 0):
                cmd += ["--level-dir", str(tmp / "level"), "--level-count", str(len(fails) + 1)]
            if g == 0:
                cmd += ["--busy-after", str(FAIL_AT), "--busy-s", str(busy_s)]
                cmd += ["--frozen"] if frozen else []
            # stderr to a file (its log lines: the guard's reports), never a pipe read only at
            # the end, which a talkative worker could fill and block on.
            with open(tmp / f"g{g}.err", "wb") as err:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err))
        # Every group's records up to STEPS were written while all groups trained: only then
        # may one stop (the others could go on without it, as after a death).
        deadline = time.monotonic() + DEADLINE_S
        while min(_last_commit(tmp / f"g{g}") for g in range(groups)) < STEPS:
            assert time.monotonic() < deadline, f"the groups did not all reach step {STEPS}"
            for g, proc in enumerate(procs):
                assert proc.poll() is None, (
                    f"group {g} exited {proc.returncode}: "
                    + (tmp / f"g{g}.err").read_text(errors="replace")[-2000:]
                )
            time.sleep(0.1)  # polling files the workers write
        stop.touch()
        for g, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"group {g} did not reach step {STEPS} in time") from None
            err = (tmp / f"g{g}.err").read_text(errors="replace")[-2000:]
            assert proc.returncode == 0, f"group {g} exited {proc.returncode}: {err}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()
    digests: dict[int, dict[int, str]] = {}
    acted: dict[str, set[int]] = {}
    for g in range(groups):
        for line in (tmp / f"g{g}").read_text().splitlines():
            record = json.loads(line)
            if "event" in record:
                acted.setdefault(record["event"], set()).add(record["step"])
            else:
                digests.setdefault(g, {})[record["step"]] = record["digest"]
                if records is not None:
                    records.setdefault(g, []).append(record)
    # The scenario happened: every failing group failed, and the busy group was busy after
    # committing, the same step, in a quorum of all the groups.
    assert len(acted.get("fail", ())) == 1 and acted.get("busy") == acted["fail"], acted
    return digests


def _last_commit(path: Path) -> int:
    # Only whole lines: the last one may be half written.
    records = [json.loads(line) for line in path.read_text().split("\n")[:-1]]
    return max((r["step"] for r in records if "digest" in r), default=0)


def divergent_steps(digests: dict[int, dict[int, str]]) -> list[int]:
    """Steps up to ``STEPS`` at which two groups committed different states.

    Later steps are left out: once a group stops, the others may fail a step (their peer left)
    and commit it again without it, as after any group's death; what a departed group held does
    not matter any more.
    """
    steps = sorted({s for per in digests.values() for s in per if s <= STEPS})
    return [s for s in steps if len({per[s] for per in digests.values() if s in per}) > 1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "groups,failing,busy_s",
    [(3, "all_but_one", 1.5), (4, "one", 0.5), (3, "all_but_one", 6.0)],
)
def test_late_committer_keeps_every_group_identical(
    groups: int, failing: str, busy_s: float, tmp_path: Path
) -> None:
    digests = run_case(tmp_path, groups, failing, busy_s)
    assert set(digests) == set(range(groups)), f"a group never committed: {sorted(digests)}"
    common = [s for s in digests[0] if sum(s in per for per in digests.values()) > 1]
    assert any(s > FAIL_AT + 1 for s in common), f"no common step after the failure: {digests}"
    bad = divergent_steps(digests)
    assert not bad, f"groups hold different weights at steps {bad}"


@pytest.mark.slow
def test_a_frozen_late_committer_heals_from_the_history_that_superseded_it(
    tmp_path: Path,
) -> None:
    # Group 0 commits step 5 and freezes (SIGSTOP: its heartbeats stop too, as in a pause that
    # holds the interpreter) past the heartbeat timeout. Declared lost, it cannot be waited
    # for: the others train step 5 again without it, and pause, so that it comes back level
    # with them at step 6. Its commit of step 5 is lost with it (its record of step 6 differs);
    # but it must heal from the others before it trains with them again.
    digests = run_case(tmp_path, 3, "all_but_one", 7.0, frozen=True, pause_after_fail=3.0)
    superseded = FAIL_AT + 1
    assert digests[0][superseded] != digests[1][superseded], "no step was trained again"
    del digests[0][superseded]
    bad = divergent_steps(digests)
    assert not bad, f"groups hold different weights at steps {bad}"
    assert max(digests[0]) >= STEPS, "group 0 did not train on with the others"


def main() -> None:
    """The issue's matrix, ``--runs`` times each: prints divergent runs per case."""
    import tempfile

    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--impl", default="torchheal")
    args = p.parse_args()
    print(f"{'groups':>6} {'failing':>12} {'busy s':>6} {'divergent runs':>15} {'wall s':>7}")
    for groups in (3, 4):
        for failing in ("one", "all_but_one"):
            for busy_s in (0.5, 1.5, 6.0):
                bad = 0
                start = time.monotonic()
                for _ in range(args.runs):
                    with tempfile.TemporaryDirectory() as tmp:
                        bad += bool(
                            divergent_steps(run_case(Path(tmp), groups, failing, busy_s, args.impl))
                        )
                wall = (time.monotonic() - start) / args.runs
                print(
                    f"{groups:>6} {failing:>12} {busy_s:>6} {bad:>8}/{args.runs:<6} {wall:>7.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
