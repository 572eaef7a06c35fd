"""A heal that fails on one rank of a group and succeeds on another (issue 9).

A group of several ranks heals rank by rank: rank r receives rank r's state of its source. When
one rank's receive fails (its source's host went away, say) and another's succeeds, the group's
ranks stand at different steps: the one that healed at the quorum's step, the other at the step
it had. Neither may train on like that, and neither may die of it: the step fails on every rank
of the group (each votes on the step the group was healing to), and the next quorum sees the
group at its lowest rank's step, so the whole group heals again. Real processes, two groups of
two ranks, the reference's default timeouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import START_BOUND_S, all_together, survivors_go_on
from tests.failfast.test_salvage import assert_every_rank_on_its_history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_heal_that_fails_on_one_rank_is_done_again_by_the_whole_group(tmp_path: Path) -> None:
    groups, victim = 2, 1
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=5_000
    ) as lh:
        job = Job(tmp_path, url(lh), groups, ranks=2)
        try:
            for g in range(groups):
                job.start(g)
            all_together(job, min_commits=3)
            killed = job.kill(victim)
            survivors_go_on(job, victim, since=killed)
            restarted = job.start(victim, per_rank={0: ("--fail-heal",)})
            job.wait_for(
                f"g{victim}'s rank 0 to fail its first heal",
                lambda events: any(e["kind"] == "heal-failing" for e in events),
                START_BOUND_S,
            )
            all_together(job, min_commits=3)

            def mine(events: list[dict]) -> list[dict]:
                return [
                    e
                    for e in events
                    if e["kind"] == "step"
                    and (e["group"], e["inc"]) == (victim, restarted.incarnation)
                ]

            # Rank 1 healed in the step rank 0 failed to heal in, and that step committed on
            # neither; both healed before they trained.
            partial = [e for e in mine(job.rank_events) if e["after"] > e["before"]]
            assert partial and not partial[0]["committed"], mine(job.rank_events)[:4]
            for rank, events in enumerate((job.events, job.rank_events)):
                assert Job.healed_first(mine(events), victim), (rank, mine(events)[:4])
            states = job.finish()
            assert_identical(states)
            steps = history(job.events)
            assert_replayed(states[0], steps, exact=True)
            assert_every_rank_on_its_history(job)
        finally:
            job.close()
