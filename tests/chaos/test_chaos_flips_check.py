"""The chaos soak's flip check (``bench/_chaos_flips.py``) on hand-made histories: a flip
reported at its step passes; one never reported, one a comparison found equal first, and a
mismatch no flip explains do not; a peer's report delayed past the repair (it was stopped) is
still the flip's."""

from __future__ import annotations

from typing import Any

from bench._chaos_flips import Flip, match, unexplained

TENSOR = "0.weight"


def step(t: float, group: int, after: int, verified: int) -> dict[str, Any]:
    guard = {"checks": 0, "mismatches": 0, "verified": verified}
    return {
        "kind": "step",
        "time": t,
        "group": group,
        "inc": 1,
        "rank": 0,
        "after": after,
        "guard": guard,
    }


def report(t: float, group: int, compared: int) -> dict[str, Any]:
    message = f"[g{group}/0 - step {compared + 1}] divergence at step {compared}: ... "
    message += f"g1 differs in default/model (tensors default/model/{TENSOR})"
    return {
        "kind": "divergence",
        "time": t,
        "group": group,
        "inc": 1,
        "rank": 0,
        "step": compared,
        "message": message,
    }


def history(reported: bool = True) -> tuple[Flip, list[dict[str, Any]]]:
    """g1 rank 0 flips a bit at step 10; the guard compares step 10 and every group reports it
    at step 11's vote; g1 heals, and step 13 is found equal."""
    flip = Flip(1, 1, 0, TENSOR, 3, 7, ordered=0.5)
    events: list[dict[str, Any]] = [step(1.0, g, 10, 9) for g in range(3)]
    events.append(
        {"kind": "flip", "time": 1.1, "id": 1, "step": 10, "group": 1, "inc": 1, "rank": 0}
    )
    events += [step(2.0, g, 11, 9) for g in range(3)]
    if reported:
        events += [report(2.1, g, 10) for g in range(3)]
    events += [step(3.0 + s, g, 12 + s, 9 if s < 2 else 11 + s) for s in range(3) for g in range(3)]
    return flip, events


def test_a_flip_reported_at_its_step_passes() -> None:
    flip, events = history()
    assert match([flip], events) == []
    assert (flip.step, flip.compared, flip.named, flip.missed) == (10, 10, True, False)
    assert unexplained([flip], events) == []


def test_a_flip_never_reported_fails() -> None:
    flip, events = history(reported=False)
    problems = match([flip], events)
    assert problems == ["flip 1 (g1 r0 0.weight[3] bit 7, at step 10) was not reported"]


def test_a_flip_a_comparison_found_equal_first_fails() -> None:
    flip, events = history()
    events.insert(5, step(1.5, 1, 10, 10))  # step 10 verified equal before the report
    assert match([flip], events) == [f"flip 1 ({flip.what()}): a comparison after it matched"]


def test_a_report_delayed_past_the_repair_is_still_the_flips() -> None:
    # g2 was stopped right after comparing step 11 and reports it when it wakes, long after g1
    # found step 12 equal.
    flip, events = history()
    events.append(report(30.0, 2, 11))
    match([flip], events)
    assert unexplained([flip], events) == []


def test_a_mismatch_no_flip_explains_fails() -> None:
    flip, events = history()
    events.append(report(40.0, 0, 20))
    match([flip], events)
    problems = unexplained([flip], events)
    assert len(problems) == 1 and "divergence at step 20" in problems[0], problems
