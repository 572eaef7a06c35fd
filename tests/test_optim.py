"""OptimizerWrapper: zero_grad starts the quorum, step is gated by the commit vote."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchheal import Optimizer
from torchheal.optim import OptimizerWrapper


class _RecordingManager:
    """Records the two Manager calls the wrapper makes (the Manager is not under test here)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.commit = True

    def start_quorum(self) -> None:
        self.calls.append("start_quorum")

    def should_commit(self) -> bool:
        self.calls.append("should_commit")
        return self.commit


def test_export_name() -> None:
    assert Optimizer is OptimizerWrapper


def test_step_gated_by_should_commit() -> None:
    model = nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    manager = _RecordingManager()
    opt = OptimizerWrapper(manager, inner)

    opt.zero_grad()
    assert manager.calls == ["start_quorum"]
    model(torch.ones(1, 3)).sum().backward()
    before = model.weight.detach().clone()
    manager.commit = False
    opt.step()
    assert manager.calls == ["start_quorum", "should_commit"]
    assert torch.equal(model.weight, before)  # rejected step: no update

    manager.commit = True
    opt.step()
    assert not torch.equal(model.weight, before)

    opt.zero_grad(set_to_none=True)
    assert model.weight.grad is None


def test_delegation() -> None:
    model = nn.Linear(3, 2)
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    manager = _RecordingManager()
    opt = OptimizerWrapper(manager, inner)
    assert opt.param_groups is inner.param_groups
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra]})
    assert len(inner.param_groups) == 2

    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    extra.grad = torch.ones(2)
    opt.step()
    assert opt.state is inner.state and len(opt.state) == 3

    saved = opt.state_dict()
    fresh = torch.optim.Adam(list(model.parameters()), lr=0.1)
    fresh.add_param_group({"params": [extra]})
    wrapped = OptimizerWrapper(manager, fresh)
    wrapped.load_state_dict(saved)
    assert wrapped.state_dict()["state"].keys() == saved["state"].keys()

    with pytest.raises(AssertionError, match="closures"):
        opt.step(closure=lambda: 0.0)
