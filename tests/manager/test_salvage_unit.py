"""The salvage rule and the kept allreduce inputs (``torchheal.manager.salvage``), alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from torchheal.manager.salvage import KeptInputs, salvage_refusal
from torchheal.manager.step import StepLedger

SALVAGEABLE: dict[str, Any] = dict(
    enabled=True,
    errored=True,
    foreign=False,
    aborted_for="replica group g2 of quorum 4 is lost (session ended)",
    kept=3,
    healing=False,
    contributed=True,
    already_salvaged=False,
)


def test_a_step_failed_by_a_lost_group_is_salvaged() -> None:
    assert salvage_refusal(**SALVAGEABLE) is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"enabled": False}, "not enabled"),
        ({"errored": False}, "nothing failed"),
        ({"foreign": True}, "the training loop reported an error"),
        ({"aborted_for": None}, "the failure was not the loss of a replica group"),
        ({"already_salvaged": True}, "the step was salvaged once already"),
        ({"healing": True}, "this replica did not contribute to the step"),
        ({"contributed": False}, "this replica did not contribute to the step"),
        ({"kept": 0}, "no allreduce was kept"),
    ],
)
def test_what_is_not_salvaged(change: dict[str, Any], reason: str) -> None:
    assert salvage_refusal(**{**SALVAGEABLE, **change}) == reason


def test_kept_inputs_are_copies_in_buffers_reused_from_step_to_step() -> None:
    kept = KeptInputs()
    a, b = torch.arange(4.0), torch.ones(2, 3)
    kept.keep(a, ReduceOp.AVG, False)
    kept.keep(b, ReduceOp.SUM, True)
    a.add_(100)  # reduced in place afterwards: the copy keeps the input
    first = kept.take()
    assert [k.tensor for k in first] == [a, b]
    assert torch.equal(first[0].kept, torch.arange(4.0))
    assert (first[1].reduce_op, first[1].should_quantize) == (ReduceOp.SUM, True)
    assert kept.take() == []

    kept.begin()
    kept.keep(torch.full((4,), 7.0), ReduceOp.AVG, False)  # same shape: same buffer
    kept.keep(torch.zeros(5), ReduceOp.AVG, False)  # another shape: a buffer of its own
    second = kept.take()
    assert second[0].kept.data_ptr() == first[0].kept.data_ptr()
    assert torch.equal(second[0].kept, torch.full((4,), 7.0))
    assert second[1].kept.shape == (5,)


class _Work:
    def __init__(self, ledger: StepLedger, fail: bool) -> None:
        self._waited = False
        self.waits = 0
        self._ledger, self._fail = ledger, fail

    def wait(self) -> bool:
        self.waits += 1
        if self._fail:
            self._ledger.report(RuntimeError("collective failed"))
        return not self._fail


def test_settle_stops_at_an_error_and_drain_waits_for_the_rest() -> None:
    ledger = StepLedger()
    ledger.begin()
    works = [_Work(ledger, fail=True), _Work(ledger, fail=False), _Work(ledger, fail=False)]
    for w in works:
        ledger.track_work(w)
    works[2]._waited = True  # handed on as a future: its holder waits for it
    ledger.settle()
    assert [w.waits for w in works] == [1, 0, 0]
    ledger.drain()
    assert [w.waits for w in works] == [1, 1, 0]


def test_only_the_training_loops_own_reports_are_foreign() -> None:
    ledger = StepLedger()
    ledger.begin()
    ledger.report(RuntimeError("allreduce aborted"))
    assert ledger.error is not None and not ledger.foreign_error
    ledger.report(ValueError("loss is nan"), foreign=True)
    assert ledger.foreign_error
    ledger.begin()
    assert ledger.error is None and not ledger.foreign_error


def test_a_dropped_group_does_not_salvage_its_step() -> None:
    # Its process group was aborted because the lighthouse dropped it (frozen past its
    # heartbeat timeout): its peers redid the step without it, and it heals instead.
    assert salvage_refusal(**SALVAGEABLE) is None
    assert salvage_refusal(**SALVAGEABLE, dropped=True) == "this group was dropped from the quorum"
