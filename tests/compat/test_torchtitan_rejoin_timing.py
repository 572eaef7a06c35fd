"""The torchtitan example's measure of the survivor's steps during a rejoin (issue 9, goal 4).

``examples/torchtitan/run_scenarios.py`` reads torchtitan's logged step lines; these tests feed
it logs written here in torchtitan's format, so the arithmetic is checked without torchtitan.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torchtitan" / "run_scenarios.py"
T0 = datetime(2026, 11, 26, 6, 0, 0)


@pytest.fixture(scope="module")
def scenarios() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("run_scenarios", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _line(at: float, text: str) -> str:
    stamp = (T0 + timedelta(seconds=at)).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    # torchtitan colours its lines; the parser strips the codes.
    return f"\x1b[32m[titan] {stamp} - root - INFO - \x1b[39m{text}\n"


def _step(at: float, step: int) -> str:
    return _line(at, f"step: {step:2d}  loss:  3.00000  grad_norm:  1.0000  memory: 0.00GiB")


def _run(scenarios: ModuleType, tmp_path: Path, name: str, lines: list[str], group: int, inc: int):
    log = tmp_path / name
    log.write_text("".join(lines))
    run = scenarios.Run(group, inc, log, None)
    run.parse()
    return run


def test_longest_survivor_step_while_a_group_rejoins(scenarios: ModuleType, tmp_path: Path) -> None:
    # Survivor: 10 s steps with both groups (steps 1-8), the kill after step 8, then steps 9-20.
    # Its step 14 takes 13 s while the restarted group heals; its step 10 takes 30 s but ends
    # (t=120) before the restart (t=125), so it must not count.
    ends = {s: 10.0 * s for s in range(1, 9)}
    t = 80.0
    for s in range(9, 21):
        t += {10: 30.0, 14: 13.0}.get(s, 10.0)
        ends[s] = t
    survivor = _run(scenarios, tmp_path, "g0", [_step(v, s) for s, v in ends.items()], 0, 0)
    killed = _run(scenarios, tmp_path, "g1a", [_step(10.0 * s + 1, s) for s in range(1, 9)], 1, 0)
    # The restarted group: its warm-up step (logged as step 1, 20 s: its slow first iteration)
    # is left out; then it heals in at step 14 (t=153) and takes step 15 (t=163).
    restarted_lines = [
        _line(130.0, "[...] joining a running job: warming up with one local step first"),
        _line(150.0, f"[...] {scenarios.WARMUP_DONE}; the next step joins the quorum"),
        _step(150.0, 1),
        _step(153.0, 14),
        _step(163.0, 15),
        _step(173.0, 16),
    ]
    restarted = _run(scenarios, tmp_path, "g1b", restarted_lines, 1, 1)
    assert restarted.warmup_step == 1 and sorted(restarted.steps) == [14, 15, 16]

    got = scenarios.survivor_during_rejoin(
        survivor, killed, restarted, (T0 + timedelta(seconds=125)).timestamp()
    )

    # The window: survivor steps ending after the restart (t=125: step 11 at 130), up to the
    # first one ending after the restarted group's second step (t=163: step 15 at 173).
    assert got == {
        "measured": True,
        "normal_step_s": 10.0,
        "steps": [11, 15],
        "longest_step": 14,
        "longest_step_s": 13.0,
        "ratio": 1.3,
    }


def test_not_measured_when_the_restarted_group_took_under_two_steps(
    scenarios: ModuleType, tmp_path: Path
) -> None:
    survivor = _run(scenarios, tmp_path, "g0", [_step(10.0 * s, s) for s in range(1, 20)], 0, 0)
    killed = _run(scenarios, tmp_path, "g1a", [_step(10.0 * s, s) for s in range(1, 9)], 1, 0)
    restarted = _run(scenarios, tmp_path, "g1b", [_step(150.0, 14)], 1, 1)

    got = scenarios.survivor_during_rejoin(
        survivor, killed, restarted, (T0 + timedelta(seconds=105)).timestamp()
    )

    assert got == {"measured": False}
