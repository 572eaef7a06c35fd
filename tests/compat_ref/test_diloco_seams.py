"""A Streaming DiLoCo fragment's sync in the reference's steps (issue 43): ``_save_grads``
(pseudo-gradients), ``_average_grads`` (their allreduce), ``_set_grads``; and the fragment's
``bucket_cap_mb`` (bytes, the reference's name), which bucketization honours."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.local_sgd.fake_manager import FakeManager
from torchheal.local_sgd import DiLoCo


def _diloco(manager: FakeManager, model: nn.Module, **kwargs) -> DiLoCo:
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.1)
    return DiLoCo(manager, [model], inner, outer, sync_every=2, **kwargs)


@pytest.mark.parametrize("bucketized", [False, True])
def test_save_average_set(bucketized: bool) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    manager = FakeManager(allreduce_fn=lambda t: t * 2)
    fragment = _diloco(manager, model, use_bucketization=bucketized)._fragments[0]
    fragment.save_parameters()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(2)
    fragment._save_grads()
    fragment._average_grads()
    assert all(p.grad is None for p in model.parameters())
    fragment._set_grads()
    for p in model.parameters():
        torch.testing.assert_close(p.grad, torch.full_like(p, -4.0))


def test_fragment_bucket_cap_is_honoured() -> None:
    counts = {}
    for cap in (1 << 30, 4):  # all in one bucket; a few bytes: a bucket per tensor
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        manager = FakeManager()
        fragment = _diloco(manager, model, use_bucketization=True)._fragments[0]
        fragment.bucket_cap_mb = cap
        fragment.save_parameters()
        fragment._save_grads()
        fragment._average_grads()
        fragment._set_grads()
        counts[cap] = manager.allreduce_calls
    assert counts[1 << 30] == 1
    assert counts[4] == 4
