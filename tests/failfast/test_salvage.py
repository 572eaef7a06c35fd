"""Salvaging the step in flight: a group dies in the middle of a step, the survivors commit it.

Real processes (``tests.failfast.worker`` with ``--salvage``: ``Manager(salvage_step=True)``)
against a real lighthouse at the reference's defaults. A group SIGKILLs itself inside its DDP
comm hook before its allreduce starts, so none of its data reaches the survivors: their
collective of that step cannot complete, and without salvage they would skip the step. With
it, each survivor redoes the step's allreduces in a new quorum without the dead group, and
commits the very step it was computing, averaged over the survivors. Then the dead group
restarts, heals, and every group ends bit-identical and on the replayed history (``replay.py``,
which takes each committed step's quorum and divisor from the workers' records: the salvaged
attempt is recorded with its own).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cluster import lighthouse, url
from tests.failfast.job import Event, Job
from tests.failfast.replay import assert_identical, assert_replayed, history
from tests.failfast.test_kill import (
    START_BOUND_S,
    SURVIVORS_BOUND_S,
    heal_and_finish,
    survivors_go_on,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_survivors_commit_the_step_a_group_died_in(tmp_path: Path) -> None:
    """Three groups; g2 dies unreduced in a step; g0 and g1 commit that step, salvaged.

    Both survivors' commit of the step is a redo in one new quorum, divided by 2, from the step
    they were computing (not a later one), and neither failed a step in between.
    """
    salvage_a_lost_group(tmp_path, "cpu")


def salvage_a_lost_group(tmp_path: Path, device: str) -> None:
    """The job of the test above, training on ``device`` (``test_salvage_gpu``: "cuda")."""
    groups, victim = 3, 2
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=5_000
    ) as lh:
        job = Job(tmp_path, url(lh), groups, device=device)
        try:
            job.start(0, "--salvage")
            job.start(1, "--salvage")
            job.start(victim, "--salvage", "--die-before-reducing", "3")
            job.expect_death(victim)
            dying = job.wait_for(
                f"g{victim} to kill itself inside its comm hook, unreduced",
                lambda events: next((e for e in events if e["kind"] == "dying"), None),
                START_BOUND_S,
            )
            job.current(victim).popen.wait(timeout=30)
            survivors = [g for g in range(groups) if g != victim]

            def step_in_flight(events: list[dict], g: int) -> dict | None:
                return next(
                    (
                        e
                        for e in events
                        if e["kind"] == "step"
                        and e["group"] == g
                        and e["before"] == dying["step"]
                        and e["time"] > dying["time"]
                    ),
                    None,
                )

            ended = job.wait_for(
                "the survivors to end the step g2 died in",
                lambda events: (
                    [step_in_flight(events, g) for g in survivors]
                    if all(step_in_flight(events, g) for g in survivors)
                    else None
                ),
                SURVIVORS_BOUND_S,
            )
            for g, e in zip(survivors, ended, strict=True):
                record = e["reduce"]
                assert e["committed"], f"g{g} skipped the step g{victim} died in: {e}"
                assert record["salvaged"], f"g{g}'s commit of that step was not a redo: {e}"
                assert record["divisor"] == groups - 1, e
                assert record["batch_step"] == dying["step"], e
            assert len({e["reduce"]["quorum_id"] for e in ended}) == 1, ended
            assert ended[0]["reduce"]["quorum_id"] != dying["quorum_id"], ended
            survivors_go_on(job, victim, since=dying["time"])
            heal_and_finish(job, victim, exact=False)
        finally:
            job.close()


def test_a_survivor_that_committed_the_step_and_one_that_salvages_it_end_alike(
    tmp_path: Path,
) -> None:
    """Three groups; the step g2 dies after went through for g0 but failed for g1.

    g0's collective completed with every group's data, so g0 commits the step as usual (divided
    by 3). g1's completed too but reported a failure (a reset just after the last byte), and g1
    learns of g2's loss before its vote: it salvages. Its redo's quorum holds g0, already a step
    ahead, so g1 does not redo the step divided by 2 (which would leave it apart from g0): it
    heals from g0 and commits the step g0 is at. Every group ends bit-identical and on the
    replayed history.
    """
    groups, victim, salvager = 3, 2, 1
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=5_000
    ) as lh:
        job = Job(tmp_path, url(lh), groups)
        try:
            job.start(0, "--salvage")
            job.start(salvager, "--salvage", "--fail-reduce", "3", "--hold-reduced", "3")
            job.start(victim, "--salvage", "--hold-reduced", "3")

            def held(events: list[dict]) -> dict[int, dict] | None:
                reduced = {e["group"]: e for e in events if e["kind"] == "reduced"}
                return reduced if len(reduced) == 2 else None

            reduced = job.wait_for("g1 and g2 to hold, their step reduced", held, START_BOUND_S)
            step = reduced[victim]["step"]
            assert reduced[salvager]["step"] == step, reduced
            assert reduced[salvager]["errored"] and not reduced[victim]["errored"], reduced

            def ended(g: int) -> Callable[[list[dict]], dict | None]:
                return lambda events: next(
                    (
                        e
                        for e in events
                        if e["kind"] == "step" and e["group"] == g and e["before"] == step
                    ),
                    None,
                )

            g0 = job.wait_for("g0 to end the step", ended(0), SURVIVORS_BOUND_S)
            assert g0["committed"] and g0["reduce"]["divisor"] == groups, g0
            assert not g0["reduce"]["salvaged"], g0
            killed = job.kill(victim)
            job.release(salvager)
            g1 = job.wait_for("g1 to end the step", ended(salvager), SURVIVORS_BOUND_S)
            assert g1["committed"], f"g1 skipped the step: {g1}"
            assert g1["reduce"]["salvaged"], f"g1's commit of that step was not a redo: {g1}"
            assert not g1["reduce"]["participating"], f"g1 redid the step instead of healing: {g1}"
            assert g1["after"] == g0["after"] + 1, (g0, g1)  # it took g0's step, then committed
            survivors_go_on(job, victim, since=killed)
            heal_and_finish(job, victim, exact=False)
        finally:
            job.close()


def test_every_rank_of_a_group_redoes_the_step_one_rank_lost(tmp_path: Path) -> None:
    """Two groups of two ranks, each rank its own process; g1 is lost in a step, mid-way.

    g1's rank 0 holds inside its comm hook before its allreduce; the rank-1 allreduce between
    the groups goes through, with both groups' data, and g0's rank 1 holds once it has (before
    its vote). The test SIGKILLs g1, both ranks (a host lost). g0's rank 0 cannot complete its
    collective (g1's rank 0 never sent): its step failed for a lost group. g0's rank 1 saw
    nothing wrong: its step would commit as it was, averaged over both groups. Committed that
    way beside rank 0's redo (averaged over g0 alone), the group's ranks would part. So the
    group's vote makes every rank redo the step, rank 1 too, from its kept input: both commit
    it alone (divided by 1) in one new quorum. Then g1 restarts (both ranks) and heals. Rank r
    of every group ends bit-identical, on rank r's replayed history, and the ranks of each group
    committed every step in the same quorum with the same divisor.
    """
    groups, victim, survivor = 2, 1, 0
    with lighthouse(
        min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100, heartbeat_timeout_ms=5_000
    ) as lh:
        job = Job(tmp_path, url(lh), groups, ranks=2)
        try:
            job.start(survivor, "--salvage", per_rank={1: ("--hold-reduced", "3")})
            job.start(victim, "--salvage", per_rank={0: ("--hold-after", "3")})
            holding = job.wait_for(
                f"g{victim}'s rank 0 to hold before reducing",
                lambda events: next((e for e in events if e["kind"] == "reducing"), None),
                START_BOUND_S,
            )
            reduced = job.wait_for(
                f"g{survivor}'s rank 1 to hold, its step reduced with both groups",
                lambda _: next((e for e in job.rank_events if e["kind"] == "reduced"), None),
                START_BOUND_S,
            )
            assert reduced["step"] == holding["step"] and not reduced["errored"], reduced
            assert reduced["divisor"] == groups, reduced
            killed = job.kill(victim)
            job.release(survivor, rank=1)

            def step_in_flight(events: list[dict]) -> dict | None:
                return next(
                    (
                        e
                        for e in events
                        if e["kind"] == "step"
                        and e["group"] == survivor
                        and e["before"] == holding["step"]
                    ),
                    None,
                )

            ended = [
                job.wait_for(
                    f"g{survivor}'s rank {rank} to end the step g{victim} was lost in",
                    lambda _, rank=rank: step_in_flight(job.rank_events if rank else job.events),
                    SURVIVORS_BOUND_S,
                )
                for rank in (0, 1)
            ]
            for rank, e in enumerate(ended):
                record = e["reduce"]
                assert e["committed"], f"rank {rank} skipped the step g{victim} was lost in: {e}"
                assert record["salvaged"], f"rank {rank}'s commit of it was not a redo: {e}"
                assert record["divisor"] == 1 and record["participating"], e
                assert record["batch_step"] == holding["step"], e
            assert ended[0]["reduce"]["quorum_id"] == ended[1]["reduce"]["quorum_id"], ended
            assert ended[0]["reduce"]["quorum_id"] != holding["quorum_id"], ended
            survivors_go_on(job, victim, since=killed)
            heal_and_finish(job, victim, exact=True)
            assert_every_rank_on_its_history(job)
        finally:
            job.close()


def assert_every_rank_on_its_history(job: Job) -> None:
    """Rank 0 is checked by ``heal_and_finish``; here every other rank r: every group's rank r
    ends bit-identical and on rank r's replayed history (two groups: exact), and it committed
    the same steps as its group's rank 0, each in the same quorum with the same divisor. One
    exception: the last step of a start the test SIGKILLed, which one rank may have recorded
    and the other not (the kill reaches the ranks one after the other)."""

    def commits(events: list[Event]) -> dict[tuple[int, int, int], tuple[int, int]]:
        return {
            (e["group"], e["inc"], e["after"]): (e["reduce"]["quorum_id"], e["reduce"]["divisor"])
            for e in Job.commits(events)
        }

    killed = {(p.group, p.incarnation) for p in job.all_procs() if p.killed}
    for rank in range(1, job.ranks):
        events = [e for e in job.rank_events if e["rank"] == rank]
        states = {g: job.final[g, rank] for g in range(job.groups)}
        assert_identical(states)
        assert_replayed(states[0], history(events), exact=True)
        mine, first = commits(events), commits(job.events)
        last = {}
        for g, inc, step in mine.keys() | first.keys():
            last[g, inc] = max(last.get((g, inc), step), step)
        apart = {
            key
            for key in mine.keys() ^ first.keys()
            if key[:2] not in killed or key[2] != last[key[:2]]
        }
        apart |= {key for key in mine.keys() & first.keys() if mine[key] != first[key]}
        assert not apart, f"rank {rank} committed apart from rank 0: {sorted(apart)}"
