"""LocalSGD/DiLoCo windows read with a guessed quorum; a sync whose quorum differs must fail.

A window's inner steps are read with the last sync's quorum; if the sync's quorum differs, the
shares do not tile the window's samples and committing would drop or double-count some.
``WindowGuard`` has every group say, before the vote, whether its window was read with the
sync's quorum (one extra one-element SUM allreduce, zero from non-contributors); one "no" fails
the sync everywhere and the same Manager step is read again with the new quorum.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.distributed import ReduceOp, Work

from torchheal.data.loader import StepLoader


class StaleWindowError(RuntimeError):
    """This sync's quorum is not the one a contributing group read its window with."""


class GuardedManager(Protocol):
    """The Manager's methods the guard forwards (its public API, plus what LocalSGD reads)."""

    _use_async_quorum: bool
    salvage_step: bool

    def start_quorum(self) -> None: ...
    def should_commit(self) -> bool: ...
    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp = ...
    ) -> Work: ...
    def report_error(self, e: Exception) -> None: ...
    def current_step(self) -> int: ...
    def num_participants(self) -> int: ...
    def participating_rank(self) -> int | None: ...
    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None: ...
    def allow_state_dict_read(self) -> None: ...
    def disallow_state_dict_read(self) -> None: ...
    def skip_warmup(self) -> None: ...


class WindowGuard:
    """A Manager for LocalSGD/DiLoCo that fails a sync whose window was read for another quorum.

    Pass it where LocalSGD/DiLoCo take the manager; everything but ``should_commit`` goes
    straight to the Manager.

    Args:
        manager: the Manager.
        loader: the loader the inner steps are read from.
    """

    def __init__(self, manager: GuardedManager, loader: StepLoader) -> None:
        self.manager = manager
        self.loader = loader
        self.stale_syncs = 0  # syncs this guard failed (any group's window was stale)

    @property
    def _use_async_quorum(self) -> bool:
        return self.manager._use_async_quorum

    @property
    def salvage_step(self) -> bool:
        """The Manager's ``salvage_step`` (LocalSGD/DiLoCo refuse it)."""
        return self.manager.salvage_step

    def stale(self) -> bool:
        """Whether this group contributes to the sync with a window read for another quorum."""
        rank = self.manager.participating_rank()
        window = self.loader.window
        if rank is None:
            return False  # not contributing: whatever it read counts for nothing
        here = (self.manager.num_participants(), rank, self.manager.current_step())
        return window is None or (window.participants, window.rank, window.step) != here

    def should_commit(self) -> bool:
        """Fails the sync when any contributing group's window was stale, then votes."""
        flag = torch.tensor([1.0 if self.stale() else 0.0])
        self.manager.allreduce(flag, reduce_op=ReduceOp.SUM).wait()
        if flag.item() > 0:
            self.stale_syncs += 1
            self.manager.report_error(
                StaleWindowError(
                    f"step {self.manager.current_step()}: the window was read for another quorum "
                    f"than this sync's ({self.manager.num_participants()} groups); read it again"
                )
            )
        return self.manager.should_commit()

    def start_quorum(self) -> None:
        """The Manager's ``start_quorum``."""
        self.manager.start_quorum()

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> Work:
        """The Manager's ``allreduce`` (average)."""
        return self.manager.allreduce(tensor, should_quantize=should_quantize)

    def current_step(self) -> int:
        """The Manager's ``current_step``."""
        return self.manager.current_step()

    def num_participants(self) -> int:
        """The Manager's ``num_participants``."""
        return self.manager.num_participants()

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None:
        """The Manager's ``register_state_dict_fn``."""
        self.manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """The Manager's ``allow_state_dict_read``."""
        self.manager.allow_state_dict_read()

    def disallow_state_dict_read(self) -> None:
        """The Manager's ``disallow_state_dict_read``."""
        self.manager.disallow_state_dict_read()

    def skip_warmup(self) -> None:
        """The Manager's ``skip_warmup`` (LocalSGD calls it)."""
        self.manager.skip_warmup()

    def compare_only(self, keys: Any) -> None:
        """The Manager's ``compare_only`` (LocalSGD and DiLoCo call it), where it has one."""
        compare_only = getattr(self.manager, "compare_only", None)
        if compare_only is not None:
            compare_only(keys)
