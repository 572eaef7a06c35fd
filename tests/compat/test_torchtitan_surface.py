"""The Manager surface torchtitan 0.3.0 uses, called the way torchtitan calls it.

Checklist of ``shared/reference/torchtitan.md`` §1: a Manager built with no state functions
that get set later (and a clear, per-step error when a heal is needed before that),
``participating_rank()`` before any quorum, the optimizer wrapper over an optimizer *container*
(torchtitan's ``OptimizersContainer`` is an ``Optimizer`` holding several and calling back into
the wrapper), ``zero_grad(set_to_none=...)``, and DiLoCo / LocalSGD as context managers over
fragments that share parameters with the model. Real lighthouse, real Gloo groups; one thread
per replica group. The process-group side (``register``, ``dist.all_reduce`` with AVG and
functional collectives with SUM and MAX) is in ``test_torchtitan_pg.py``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from tests.cluster import TIMEOUT, lighthouse, run_parallel, url
from torchheal import Optimizer
from torchheal.coordination.lighthouse.server import LighthouseServer
from torchheal.local_sgd import DiLoCo, LocalSGD
from torchheal.manager import Manager
from torchheal.process_group import ProcessGroupGloo

pytestmark = pytest.mark.timeout(90)


@contextmanager
def titan_manager(lh: LighthouseServer, name: str, **kwargs: Any) -> Iterator[Manager]:
    """A one-rank replica group's Manager, constructed as torchtitan constructs it."""
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"torchtitan_ft_{name}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=url(lh),
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        **kwargs,
    )
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)


class Container(torch.optim.Optimizer):
    """Like torchtitan's OptimizersContainer: one optimizer per model part, stepped together."""

    def __init__(self, parts: list[nn.Module], lr: float = 0.1) -> None:
        self.optimizers = [torch.optim.SGD(p.parameters(), lr=lr) for p in parts]
        params = [p for part in parts for p in part.parameters()]
        super().__init__(params, {"lr": lr})

    def step(self, closure: Any = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class FTContainer(Container):
    """Like TorchFTOptimizersContainer: step/zero_grad go through torchheal.Optimizer once."""

    def __init__(self, manager: Manager, parts: list[nn.Module], lr: float = 0.1) -> None:
        super().__init__(parts, lr)
        self._ft = Optimizer(manager, self)
        self._use_ft = True

    def step(self, closure: Any = None) -> None:
        if self._use_ft:
            self._use_ft = False
            try:
                self._ft.step()
            finally:
                self._use_ft = True
        else:
            super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._use_ft:
            self._use_ft = False
            try:
                self._ft.zero_grad(set_to_none=set_to_none)
            finally:
                self._use_ft = True
        else:
            super().zero_grad(set_to_none=set_to_none)


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _set_fns(manager: Manager, model: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchtitan calls the old name
        manager.set_state_dict_fns(model.load_state_dict, model.state_dict)


def _train_step(manager: Manager, model: nn.Module, opt: FTContainer, x: float) -> bool:
    opt.zero_grad(set_to_none=False)
    loss = model(torch.full((2, 4), x)).sum()
    loss.backward()
    for p in model.parameters():
        manager.allreduce(p.grad)
    opt.step()
    return manager.errored() is None


def test_participating_rank_is_none_before_the_first_quorum() -> None:
    with lighthouse(min_replicas=1) as lh, titan_manager(lh, "0") as m:
        assert m.participating_rank() is None
        assert m.num_participants() == 0


def test_state_fns_set_after_construction_heal_a_peer_through_a_container() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        titan_manager(lh, "0") as m0,
        titan_manager(lh, "1") as m1,
    ):
        models = [_model(0), _model(1)]  # different weights: group 1 must heal from group 0
        opts = []
        for m, model in zip((m0, m1), models, strict=True):
            _set_fns(m, model)
            opts.append(FTContainer(m, [model[0], model[1]]))
        for _ in range(3):
            ok = run_parallel(
                *(
                    lambda m=m, model=model, o=o: _train_step(m, model, o, 1.0)
                    for m, model, o in zip((m0, m1), models, opts, strict=True)
                )
            )
            assert ok == [True, True]
        assert m0.current_step() == m1.current_step() == 3
        for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(p0, p1)


def test_zero_grad_set_to_none_false_keeps_zeroed_tensors() -> None:
    with lighthouse(min_replicas=1) as lh, titan_manager(lh, "0") as m:
        model = _model(0)
        _set_fns(m, model)
        opt = FTContainer(m, [model])
        assert _train_step(m, model, opt, 1.0)
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        m.should_commit()
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())


def test_heal_needed_before_state_fns_are_set_is_a_step_error_not_a_crash() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        titan_manager(lh, "0") as m0,
        titan_manager(lh, "1") as m1,
    ):
        models = [_model(0), _model(1)]
        opts = [FTContainer(m, [model]) for m, model in zip((m0, m1), models, strict=True)]

        def step(i: int) -> tuple[bool, str]:
            ok = _train_step((m0, m1)[i], models[i], opts[i], 1.0)
            err = (m0, m1)[i].errored()
            return ok, "" if err is None else str(err.original_exception)

        (ok0, err0), (ok1, err1) = run_parallel(lambda: step(0), lambda: step(1))
        assert not ok0 and not ok1  # neither commits, neither raises
        assert "state_dict" in err0  # the source has nothing to send
        assert "load_state_dict" in err1 and "register_state_dict_fn" in err1  # the healer
        assert m0.current_step() == m1.current_step() == 0
        # Setting the functions later is enough: the next step heals and commits.
        for m, model in zip((m0, m1), models, strict=True):
            _set_fns(m, model)
        assert run_parallel(lambda: step(0), lambda: step(1)) == [(True, ""), (True, "")]
        assert m0.current_step() == m1.current_step() == 1


class _Fragmented(nn.Module):
    """A model plus bare ``nn.Module`` fragments sharing its parameters (torchtitan's
    ``fragment_llm``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = _model(seed)
        self.fragments = [nn.Module(), nn.Module()]
        self.fragments[0].layer = self.body[0]
        self.fragments[1].layer = self.body[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _semi_sync_run(kind: str, steps: int) -> list[list[torch.Tensor]]:
    with (
        lighthouse(min_replicas=2) as lh,
        titan_manager(lh, "0", use_async_quorum=False) as m0,
        titan_manager(lh, "1", use_async_quorum=False) as m1,
    ):
        models = [_Fragmented(0), _Fragmented(1)]
        barrier = threading.Barrier(2)

        def run(i: int) -> list[torch.Tensor]:
            manager, model = (m0, m1)[i], models[i]
            inner = Container([model.body[0], model.body[1]], lr=0.05)
            if kind == "diloco":
                outer = [
                    torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                    for f in model.fragments
                ]
                ctx: Any = DiLoCo(manager, model.fragments, inner, outer, sync_every=4)
            else:
                ctx = LocalSGD(manager, model.body, inner, sync_every=3)
            _set_fns(manager, model.body)
            barrier.wait(timeout=30)
            with ctx:
                for s in range(steps):
                    inner.zero_grad()
                    model(torch.full((2, 4), float(i + s))).pow(2).sum().backward()
                    inner.step()
            return [p.detach().clone() for p in model.parameters()]

        return run_parallel(lambda: run(0), lambda: run(1), timeout=60)


@pytest.mark.parametrize(("kind", "steps"), [("diloco", 8), ("local_sgd", 6)])
def test_semi_sync_context_managers_over_shared_fragments(kind: str, steps: int) -> None:
    # Both runs end on a sync step, so the groups end with the same weights.
    p0, p1 = _semi_sync_run(kind, steps)
    for a, b in zip(p0, p1, strict=True):
        torch.testing.assert_close(a, b)


def test_manager_names_the_rebuilt_group_after_the_quorum() -> None:
    """The Manager passes the newer reference's configure keywords (replica ids give the
    global ranks: ``torchtitan_ft_{i}`` is replica group ``i``)."""
    with (
        lighthouse(min_replicas=2) as lh,
        titan_manager(lh, "0") as m0,
        titan_manager(lh, "1") as m1,
    ):
        models = [_model(0), _model(0)]
        opts = []
        for m, model in zip((m0, m1), models, strict=True):
            _set_fns(m, model)
            opts.append(FTContainer(m, [model]))
        run_parallel(
            *(
                lambda m=m, model=model, o=o: _train_step(m, model, o, 1.0)
                for m, model, o in zip((m0, m1), models, opts, strict=True)
            )
        )
        for m in (m0, m1):
            options = m._pg.parent._get_backend(torch.device("cpu")).options
            assert options.group_name == f"torchft_{m._quorum_id}_rank_0"
            assert options.global_ranks_in_group == [0, 1]
