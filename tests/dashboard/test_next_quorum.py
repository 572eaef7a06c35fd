"""The dashboard's "next quorum" line says what is true between rounds (issue 41).

The lighthouse's reason is what a decision taken now would say: between the rounds of a
healthy job nobody asks, so it reads "New quorum not ready, only have 0 participants", which the
page used to show in green while every group trained.
"""

from __future__ import annotations

from torchheal.coordination.lighthouse.dashboard.view import next_quorum

NOT_READY = "New quorum not ready, only have 0 participants, need min_replicas 1 [...]"


def test_between_rounds_the_groups_are_training() -> None:
    text = next_quorum(NOT_READY, 7, 3, age_s=0.4, asking=0, timeout_s=5.0)
    assert text == "between rounds: the 3 groups of quorum #7 are training"


def test_a_round_that_started_says_who_asked() -> None:
    reason = "New quorum not ready, only have 1 participants, need at least half of 3 [...]"
    text = next_quorum(reason, 7, 3, age_s=0.4, asking=1, timeout_s=5.0)
    assert text.startswith("round starting: 1 of the 3 groups of quorum #7 asked")
    assert reason in text


def test_a_stall_or_a_start_shows_the_lighthouse_reason() -> None:
    # Long after the last quorum (or before any) the reason explains the wait: shown as is.
    assert next_quorum(NOT_READY, 7, 3, age_s=30.0, asking=0, timeout_s=5.0) == NOT_READY
    assert next_quorum(NOT_READY, 0, 0, age_s=None, asking=0, timeout_s=5.0) == NOT_READY
    found = "Fast quorum found! [...]"
    assert next_quorum(found, 7, 3, age_s=0.1, asking=3, timeout_s=5.0) == found
