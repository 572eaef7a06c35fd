"""The chaos soak's history check (``bench/_chaos_check.py``) on hand-made histories: a stale
re-run that was healed over passes; a split brain, a re-run that was kept and two divisors in one
quorum do not."""

from __future__ import annotations

from bench._chaos_check import Event, check_history


def commit(t: float, group: int, before: int, quorum: int, divisor: int, after: int = -1) -> Event:
    return {
        "kind": "step",
        "time": t,
        "group": group,
        "inc": 1,
        "rank": 0,
        "before": before,
        "after": before + 1 if after < 0 else after,
        "committed": True,
        "reduce": {"quorum_id": quorum, "participating": True, "divisor": divisor},
    }


def base() -> list[Event]:
    """g0 and g1 commit steps 0-1 in quorum 1; g0 goes quiet (its rebuild hangs) and g1 goes on
    alone in quorum 2 up to step 5; then g1 goes quiet too."""
    events = [commit(1 + s, g, s, 1, 2) for s in range(2) for g in (0, 1)]
    return events + [commit(3 + s, 1, 2 + s, 2, 1) for s in range(4)]


def rerun(events: list[Event]) -> list[Event]:
    """g0 comes back alone: quorum 3 of its own re-runs steps 2-3 from its older state."""
    return events + [commit(20 + s, 0, 2 + s, 3, 1) for s in range(2)]


def test_a_stale_rerun_healed_over_is_no_split_brain() -> None:
    # g1 is back: quorum 4 heals g0 from step 4 of its dropped branch to g1's step 6.
    events = [*rerun(base()), commit(30, 0, 4, 4, 1, after=7), commit(30, 1, 6, 4, 1)]
    assert check_history(events) == (7, [])


def test_two_quorums_committing_at_once_is_a_split_brain() -> None:
    # g1 still commits steps 6-7 in quorum 2 while g0's quorum 3 re-runs 2-3.
    events = rerun(base()) + [commit(20.5 + s, 1, 6 + s, 2, 1) for s in range(2)]
    events += [commit(30, 0, 4, 4, 1, after=9), commit(30, 1, 8, 4, 1)]
    _, problems = check_history(events)
    assert [p.split(" committed")[0] for p in problems] == ["step 2", "step 3"]


def test_a_rerun_the_job_kept_lost_steps() -> None:
    # g1 never comes back: the job goes on from g0's branch, which dropped g1's steps 4-5.
    events = rerun(base()) + [commit(30 + s, 0, 4 + s, 3, 1) for s in range(3)]
    _, problems = check_history(events)
    assert [p.split(" committed")[0] for p in problems] == ["step 2", "step 3", "step 4", "step 5"]


def test_one_quorum_two_divisors() -> None:
    events = [*base(), commit(3.5, 0, 2, 2, 2)]
    _, problems = check_history(events)
    assert problems == ["step 2 committed in different (quorum, divisor): {(2, 1), (2, 2)}"]
