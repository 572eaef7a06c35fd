"""Replay a job's committed history from its workers' events, in this process.

At ``min_replica_size=1`` a job with failures cannot match a failure-free run: while a group is
down (or heals), the survivors commit steps without its data. What every group must end with is
the result of the steps the job *actually committed*: for each step, the gradients of the groups
that contributed to it, summed and divided by the divisor the job used, applied by the same
optimizer. The workers' ``reduce`` events say who contributed to which step in which quorum
(written before the collective, so a group killed during it is still counted), and their ``step``
events say which attempt committed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from tests.failfast.worker import make_optimizer, seed_of
from tests.integration.workers import batch, make_model


@dataclass(frozen=True)
class CommittedStep:
    """One step of the job's history.

    Args:
        step: the step number.
        quorum_id: the quorum it was reduced in.
        divisor: what the sum of gradients was divided by.
        contributors: ``(group, incarnation)`` of every group whose batch was in the sum.
        committers: groups that committed it.
    """

    step: int
    quorum_id: int
    divisor: int
    contributors: tuple[tuple[int, int], ...]
    committers: tuple[int, ...]


def history(events: list[dict]) -> list[CommittedStep]:
    """The job's committed steps, 0..N-1, from the workers' events.

    Raises:
        AssertionError: a step is missing, or groups committed the same step with different
            contributors or divisors (the job split). The same step committed in two quorums
            with the same contributors and divisor is one update: a group frozen in a
            collective that it alone completed after waking (it had every peer's data), while
            its peers, released by the lighthouse, redid the step without it; a healer, which
            contributes nothing, commits such a step as they do.
    """
    commits: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e["kind"] == "step" and e["committed"]:
            assert e["reduce"] is not None, f"a commit without a reduction: {e}"
            # A commit makes step ``after``, so it computed ``after - 1``. (A healing group's
            # own step may only move to the job's at the commit: its reduce record shows the
            # step it came from, but it contributes nothing.)
            commits[e["after"] - 1].append(e)
    contributed: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
    for e in events:
        if e["kind"] == "reduce" and e["participating"]:
            assert e["batch_step"] == e["step"], f"a contributor computed another step: {e}"
            contributed[(e["step"], e["quorum_id"])].add((e["group"], e["inc"]))
    steps = sorted(commits)
    assert steps == list(range(len(steps))), f"committed steps are not 0..N-1: {steps}"
    out = []
    for step in steps:
        seen = {
            (tuple(sorted(contributed[(step, e["reduce"]["quorum_id"])])), e["reduce"]["divisor"])
            for e in commits[step]
        }
        assert len(seen) == 1, f"step {step} committed in different ways: {commits[step]}"
        ((contributors, divisor),) = seen
        quorum_id = min(e["reduce"]["quorum_id"] for e in commits[step])
        assert contributors, f"step {step} committed with no contributor"
        out.append(
            CommittedStep(
                step,
                quorum_id,
                divisor,
                contributors,
                tuple(sorted(e["group"] for e in commits[step])),
            )
        )
    return out


@contextmanager
def _one_thread() -> Iterator[None]:
    # The workers compute with one thread; so does the replay (the same kernels, the same sums).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def replay(steps: list[CommittedStep]) -> dict[str, torch.Tensor]:
    """The weights the committed history produces.

    The sum of gradients goes in group order; Gloo may add them in another order, which only
    matters (in the last bits) when a step had three or more contributors.
    """
    assert steps and len(steps[0].contributors) == 1, (
        f"step 0 must have one contributor (the init_sync primary): {steps[:1]}"
    )
    ((group, incarnation),) = steps[0].contributors
    with _one_thread():
        model = make_model(seed_of(group, incarnation))
        optimizer = make_optimizer(model)
        params = list(model.parameters())
        for s in steps:
            total: list[torch.Tensor] | None = None
            for g, _ in s.contributors:
                model.zero_grad()
                x, y = batch(g, 0, s.step)
                nn.functional.mse_loss(model(x), y).backward()
                grads = [p.grad.detach().clone() for p in params]
                total = (
                    grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
                )
            assert total is not None
            for p, t in zip(params, total, strict=True):
                p.grad = t.div_(s.divisor)
            optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def max_contributors(steps: list[CommittedStep]) -> int:
    return max(len(s.contributors) for s in steps)


def assert_identical(states: dict[int, dict[str, torch.Tensor]]) -> None:
    """Every group ended with bit-identical weights."""
    groups = sorted(states)
    for g in groups[1:]:
        for key, value in states[groups[0]].items():
            torch.testing.assert_close(
                states[g][key], value, rtol=0, atol=0, msg=f"g{g} vs g{groups[0]}: {key}"
            )


def assert_replayed(
    weights: dict[str, torch.Tensor], steps: list[CommittedStep], *, exact: bool
) -> None:
    """``weights`` are what the committed history produces (bit for bit when ``exact``).

    Args:
        weights: a group's final weights.
        steps: the history.
        exact: compare bit for bit; otherwise to a few float32 ulps' worth per step (the sum of
            three or more contributions may be added in another order by Gloo).
    """
    expected = replay(steps)
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, **tolerance, msg=f"replay: {key}")
