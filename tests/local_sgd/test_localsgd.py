"""LocalSGD: hook counts, averaging on commit, local weights kept on a failed commit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.cluster import lighthouse, replica
from tests.local_sgd.fake_manager import FakeManager
from torchheal.local_sgd import DiLoCo, LocalSGD, extract_local_tensor


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))  # 4 parameters


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()


def test_sync_every_two_counts() -> None:
    model = _model()
    manager = FakeManager()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(manager, model, optimizer, sync_every=2):
        _train_step(model, optimizer)
        assert (manager.quorum_calls, manager.commit_calls, manager.allreduce_calls) == (0, 0, 0)
        _train_step(model, optimizer)
        assert manager.quorum_calls == 1
        assert manager.commit_calls == 1
        assert manager.allreduce_calls == 4
        assert manager.events == [
            "disallow_state_dict_read",
            "disallow_state_dict_read",
            "start_quorum",
            *["allreduce"] * 4,
            "should_commit:True",
        ]
        assert manager.state_dict_read_allowed


def test_commit_writes_the_averages() -> None:
    model = _model()
    manager = FakeManager(allreduce_fn=lambda t: t * 0.5)  # stand-in "average"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(manager, model, optimizer, sync_every=1):
        optimizer.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        before_sync = [p.detach().clone() - 0.1 * p.grad for p in model.parameters()]
        optimizer.step()
    for p, expected in zip(model.parameters(), before_sync, strict=True):
        torch.testing.assert_close(p.detach(), expected * 0.5)


def test_failed_commit_keeps_local_weights() -> None:
    model = _model()
    manager = FakeManager(allreduce_fn=lambda t: t * 0.0, commits=[False])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(manager, model, optimizer, sync_every=1):
        optimizer.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        expected = [p.detach().clone() - 0.1 * p.grad for p in model.parameters()]
        optimizer.step()
    assert manager.commit_calls == 1
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.detach(), e)


def test_exceptions_propagate_and_hooks_are_removed() -> None:
    model = _model()
    manager = FakeManager()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom"):
        with LocalSGD(manager, model, optimizer, sync_every=1):
            raise RuntimeError("boom")
    _train_step(model, optimizer)
    assert manager.events == []


def test_sync_every_must_be_positive() -> None:
    model = _model()
    with pytest.raises(ValueError, match="sync_every"):
        LocalSGD(FakeManager(), model, torch.optim.SGD(model.parameters(), lr=0.1), 0)


def test_counter_resets_after_sync() -> None:
    model = _model()
    manager = FakeManager()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(manager, model, optimizer, sync_every=3):
        for _ in range(7):
            _train_step(model, optimizer)
    assert manager.quorum_calls == 2
    assert manager.allreduce_calls == 8


def test_extract_local_tensor() -> None:
    p = nn.Parameter(torch.arange(4.0))
    p.grad = torch.ones(4)
    out = extract_local_tensor(p)
    assert out.grad is None
    assert not out.requires_grad
    assert out.data_ptr() != p.data_ptr()
    torch.testing.assert_close(out, torch.arange(4.0))
    out.add_(1)
    torch.testing.assert_close(p.detach(), torch.arange(4.0))


def test_a_salvaging_manager_is_refused() -> None:
    """LocalSGD and DiLoCo read their reduced tensors before voting: no salvaged redo."""
    model = nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with (
        lighthouse(min_replicas=1) as lh,
        replica(lh, "a", salvage_step=True, use_async_quorum=False) as a,
    ):
        with pytest.raises(ValueError, match="salvage_step=False"):
            LocalSGD(a.manager, model, inner, sync_every=2)
        with pytest.raises(ValueError, match="salvage_step=False"):
            DiLoCo(a.manager, [model], inner, outer, sync_every=2)
