"""Fault-tolerant DDP wrappers over real Managers (two replica groups on threads)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.cluster import TIMEOUT, Replica, lighthouse, replica, run_parallel
from torchheal import DistributedDataParallel
from torchheal.ddp import PureDistributedDataParallel
from torchheal.process_group.gloo import ProcessGroupGloo
from torchheal.process_group.wrappers import FakeProcessGroupWrapper

pytestmark = pytest.mark.timeout(60)


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical weights in every replica (init_sync=False)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))


def _local_grads(seed: int) -> list[torch.Tensor]:
    model = _model()
    model(_inputs(seed)).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _train_step(r: Replica, module: nn.Module, seed: int) -> tuple[list[torch.Tensor], bool]:
    r.manager.start_quorum()
    module(_inputs(seed)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return grads, r.manager.should_commit()


@pytest.mark.parametrize("wrap", [DistributedDataParallel, PureDistributedDataParallel])
def test_gradients_are_averaged_across_replicas(wrap: Any) -> None:
    expected = [(g0 + g1) / 2 for g0, g1 in zip(_local_grads(1), _local_grads(2), strict=True)]
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", init_sync=False) as a,
        replica(lh, "b", init_sync=False) as b,
    ):
        # Built here, one after the other: _model() seeds the global RNG, so two threads
        # building at once could interleave and start the replicas from different weights.
        module_a, module_b = wrap(a.manager, _model()), wrap(b.manager, _model())
        (grads_a, ok_a), (grads_b, ok_b) = run_parallel(
            lambda: _train_step(a, module_a, 1), lambda: _train_step(b, module_b, 2)
        )
    assert ok_a and ok_b
    for ga, gb, e in zip(grads_a, grads_b, expected, strict=True):
        torch.testing.assert_close(ga, e)
        torch.testing.assert_close(gb, e)


@pytest.mark.parametrize("wrap", [DistributedDataParallel, PureDistributedDataParallel])
def test_failed_reduction_still_completes_backward(wrap: Any) -> None:
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        module = wrap(r.manager, _model())
        r.manager.start_quorum()
        r.manager.wait_quorum()
        pg.report_future_error(RuntimeError("injected reduction failure"))
        module(_inputs(1)).sum().backward()
        assert all(p.grad is not None for p in module.parameters())
        assert "injected reduction failure" in str(r.manager.errored())
        assert r.manager.should_commit() is False


@pytest.mark.parametrize("wrap", [DistributedDataParallel, PureDistributedDataParallel])
def test_errored_manager_still_completes_backward(wrap: Any) -> None:
    with lighthouse() as lh, replica(lh, "a") as r:
        module = wrap(r.manager, _model())
        r.manager.start_quorum()
        r.manager.report_error(RuntimeError("earlier failure"))
        module(_inputs(1)).sum().backward()
        for got, local in zip((p.grad for p in module.parameters()), _local_grads(1), strict=True):
            torch.testing.assert_close(got, local)  # untouched local gradient
        assert r.manager.should_commit() is False


def test_ddp_rejects_fixed_arguments() -> None:
    with lighthouse() as lh, replica(lh, "a") as r:
        with pytest.raises(ValueError, match="find_unused_parameters"):
            DistributedDataParallel(r.manager, _model(), find_unused_parameters=False)


def test_ddp_skips_its_start_up_sync() -> None:
    # Over the dummy group of one, DDP's start-up broadcast changes nothing but copies every
    # parameter and buffer twice (seconds for a large state, on a restarted group's way to its
    # first commit). The Manager brings replicas in sync.
    with lighthouse() as lh, replica(lh, "a") as r:
        model = _model()
        model.register_buffer("ballast", torch.zeros(1000))
        ddp = DistributedDataParallel(r.manager, model)
        assert ddp.process_group.wait_count == 0
        # Whoever asks for it explicitly still gets it.
        synced = DistributedDataParallel(r.manager, _model(), init_sync=True)
        assert synced.process_group.wait_count > 0


def test_gradients_are_bucket_views_unless_asked_otherwise() -> None:
    # No copy of the reduced bucket back into gradients of their own (see the class docstring);
    # the values are the same either way.
    grads = {}
    with lighthouse() as lh, replica(lh, "a") as r:
        for views in (True, False):
            kwargs = {} if views else {"gradient_as_bucket_view": False}
            module = DistributedDataParallel(r.manager, _model(), **kwargs)
            for step in range(2):  # the second backward starts from gradients set to None
                r.manager.start_quorum()
                module.zero_grad(set_to_none=True)
                module(_inputs(step)).sum().backward()
                assert r.manager.should_commit()
            # A view's base is DDP's bucket; a gradient of its own has none.
            assert all((p.grad._base is not None) == views for p in module.parameters())
            grads[views] = [p.grad.clone() for p in module.parameters()]
    for with_views, without in zip(grads[True], grads[False], strict=True):
        assert torch.equal(with_views, without)


def test_a_salvaging_manager_refuses_gradients_copied_out_of_the_buckets() -> None:
    with lighthouse(min_replicas=1) as lh, replica(lh, "a", salvage_step=True) as a:
        with pytest.raises(ValueError, match="gradient_as_bucket_view=False"):
            DistributedDataParallel(a.manager, _model(), gradient_as_bucket_view=False)
        DistributedDataParallel(a.manager, _model())  # the default (views) is fine
