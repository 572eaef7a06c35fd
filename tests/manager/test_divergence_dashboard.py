"""The lighthouse's dashboard hears each group's divergence guard (issue 41, "Visible").

Two one-rank groups seeded differently against a real lighthouse with its dashboard: group rank
0's Manager sends its guard's counts with each quorum request, the manager server passes them
on as the group's ``QuorumMember.data``, and ``/api/status`` shows each group's last verified
step, its mismatches, and a mark where they rose.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster import replica, run_parallel, train_step
from tests.dashboard.helpers import get_json, lighthouse_with_dashboard, wait_until

pytestmark = pytest.mark.timeout(60)


def test_status_shows_each_groups_verified_step_and_the_mismatch() -> None:
    # As in test_divergence_threads: step 1 is compared and differs (its verdict is taken at
    # step 2's vote, where b votes no); b heals, step 4 matches (verdict at step 5's vote).
    # Each request carries the counts as of the vote before it, so the 7th request, at a's
    # step 6 and b's, is the first to report step 4 verified.
    kwargs = dict(init_sync=False, divergence_check_interval=1)
    with (
        lighthouse_with_dashboard(min_replicas=2) as (lh, _, url),
        replica(lh, "a", weight=3.0, **kwargs) as a,
        replica(lh, "b", weight=0.0, **kwargs) as b,
    ):
        results = [run_parallel(lambda: train_step(a), lambda: train_step(b)) for _ in range(7)]
        assert results[2] == [True, False]  # b found different (the guard ran)

        def reported() -> dict[str, Any] | None:
            doc = get_json(url + "api/status")
            if doc["quorum"]["id"] and {g["verified"] for g in doc["guard"].values()} == {4}:
                return doc
            return None

        doc = wait_until(reported, what="both groups' verified step 4 on the dashboard")
        assert set(doc["guard"]) == {"a", "b"}
        # Steps 1 and 2 differed (b waited a step to heal); steps 1, 2 and 4 were judged.
        for group in ("a", "b"):
            assert doc["guard"][group]["mismatches"] == 2
            assert doc["guard"][group]["checks"] == 3
        members = {m["group"]: m for m in doc["quorum"]["members"]}
        assert {g: (m["verified"], m["mismatches"]) for g, m in members.items()} == {
            "a": (4, 2),
            "b": (4, 2),
        }
        # A mark where each group's count rose: the 4th requests (a at step 3; b at step 2, as
        # it did not commit) carried the first mismatch, the 5th (both at step 4) the second.
        marks = sorted((d["group"], d["step"], d["mismatches"]) for d in doc["divergences"])
        assert marks == [("a", 3, 1), ("a", 4, 2), ("b", 2, 1), ("b", 4, 2)]
