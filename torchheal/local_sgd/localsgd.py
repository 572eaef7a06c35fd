"""LocalSGD: train locally, average the model across replica groups every ``sync_every`` steps.

Also home of what LocalSGD and DiLoCo share (:class:`SyncManager`, the optimizer hooks). Hooks
keep the user's loop unchanged; the pre-step one stops state-dict reads while ``step()``
mutates the model, so a healing peer never receives half-updated weights.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.distributed import Work
from torch.utils.hooks import RemovableHandle

from torchheal._base.salvage_guard import refuse_salvage
from torchheal.utils import dtensor_type

__all__ = ["LocalSGD", "OptimizerStepHooks", "SyncManager", "extract_local_tensor"]


class SyncManager(Protocol):
    """What LocalSGD/DiLoCo need from :class:`torchheal.manager.Manager`.

    ``allreduce`` must reduce *in place*: after the work's ``wait()`` the tensor holds the
    average over the participating replicas.
    """

    _use_async_quorum: bool

    def start_quorum(self) -> None: ...
    def should_commit(self) -> bool: ...
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> Work: ...
    def current_step(self) -> int: ...
    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None: ...
    def allow_state_dict_read(self) -> None: ...
    def disallow_state_dict_read(self) -> None: ...


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor; never imports DTensor's slow module (until something has,
    nothing can be one)."""
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached clone of ``t``'s local data (``t.to_local()`` for a DTensor), without grad."""
    with torch.no_grad():
        local = t.to_local() if is_dtensor(t) else t
        out = local.detach().clone()
    out.grad = None
    return out


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor to write into so that ``t``'s (local) data changes: ``t.data`` or its shard."""
    data = t.data
    return data.to_local() if is_dtensor(data) else data


_Hooked = TypeVar("_Hooked", bound="OptimizerStepHooks")


class OptimizerStepHooks:
    """Context-manager plumbing shared by LocalSGD and DiLoCo: hooks around ``optimizer.step``.

    The post-step hook calls :meth:`_after_step`. Subclasses set ``_manager`` and
    ``_hooked_optimizer`` and implement ``_after_step``.
    """

    _manager: SyncManager
    _hooked_optimizer: torch.optim.Optimizer
    _hooks: list[RemovableHandle]

    def __enter__(self: _Hooked) -> _Hooked:
        self._hooks = [
            self._hooked_optimizer.register_step_pre_hook(self._step_pre_hook),
            self._hooked_optimizer.register_step_post_hook(self._step_post_hook),
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        for hook in getattr(self, "_hooks", []):
            hook.remove()
        self._hooks = []
        return False  # never swallow the training loop's exception

    def _step_pre_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        # The optimizer is about to mutate the model: no checkpoint may be read meanwhile.
        self._manager.disallow_state_dict_read()

    def _step_post_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.allow_state_dict_read()
        self._after_step()

    def _after_step(self) -> None:
        raise NotImplementedError


class LocalSGD(OptimizerStepHooks):
    """Averages the model across replica groups every ``sync_every`` optimizer steps.

    Use as a context manager around the training loop; it hooks ``optimizer.step``. At a sync,
    it starts a quorum, allreduces (AVG) a copy of every parameter and, if the step commits,
    writes the averages into the model; otherwise the local weights are kept.

    With the manager's async quorum a replica that joins discards its first window (it heals
    only at the sync); use ``use_async_quorum=False`` to heal before training.

    Args:
        manager: the fault-tolerance manager of this replica group.
        model: the model whose parameters are averaged.
        optimizer: the inner optimizer whose steps are counted.
        sync_every: number of optimizer steps between syncs (>= 1).
    """

    def __init__(
        self,
        manager: SyncManager,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        refuse_salvage(manager, type(self).__name__)
        # The local models and optimizers differ between syncs by design: the divergence guard
        # compares only the Manager's counters (a Manager without a guard: nothing).
        compare_only = getattr(manager, "compare_only", None)
        if compare_only is not None:
            compare_only([])
        self._manager = manager
        self._model = model
        self._optimizer = optimizer
        self._hooked_optimizer = optimizer
        self._sync_every = sync_every
        self._local_step = 0
        self._hooks = []
        # The first sync comes after sync_every local steps: the warm-up a restarted group's
        # Manager would take alone is done by then, and would only delay its heal by a window.
        skip_warmup = getattr(manager, "skip_warmup", None)
        if skip_warmup is not None:
            skip_warmup()

    def _after_step(self) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Start a quorum and average the model now (normally called by the step hook)."""
        self._manager.start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        averaged = self._average()
        if self._manager.should_commit():
            with torch.no_grad():
                for param, avg in zip(self._model.parameters(), averaged, strict=True):
                    local_view(param).copy_(avg)

    def _average(self) -> list[torch.Tensor]:
        copies = [extract_local_tensor(p.data) for p in self._model.parameters()]
        works = [self._manager.allreduce(t) for t in copies]
        for work in works:
            work.wait()
        return copies
