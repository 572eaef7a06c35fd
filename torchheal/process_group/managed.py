"""``ManagedProcessGroup``: the cross-replica dimension of a device mesh, driven by a Manager.

The manager is duck-typed so this module never imports ``torchheal.manager`` (a layer above).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllreduceOptions,
    ReduceOp,
)

from torchheal._base.salvage_guard import refuse_salvage
from torchheal.process_group.base import ProcessGroup


class _ManagerLike(Protocol):
    """The part of ``torchheal.Manager`` a managed process group needs."""

    _pg: Any

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = ..., reduce_op: Any = ...
    ) -> dist.Work: ...

    def num_participants(self) -> int: ...


def _reduce_op(opts: AllreduceOptions | ReduceOp | ReduceOp.RedOpType) -> ReduceOp:
    # c10d hands Python groups an AllreduceOptions; direct callers may pass a bare op.
    if isinstance(opts, AllreduceOptions):
        return opts.reduceOp
    if isinstance(opts, ReduceOp.RedOpType):
        return ReduceOp(opts)
    if isinstance(opts, ReduceOp):
        return opts
    raise TypeError(
        f"ManagedProcessGroup.allreduce: opts must be AllreduceOptions or ReduceOp, "
        f"got {type(opts).__name__}"
    )


class ManagedProcessGroup(ProcessGroup):
    """A process group whose all-reduce is ``manager.allreduce`` (fault tolerant, per-step).

    ``allreduce`` accepts exactly one tensor and forwards the reduce op (``AVG`` divides by the
    number of participating replicas, ``SUM``/``MAX``/... pass through). ``size()`` is the number
    of participants in the current quorum. Other collectives are issued on the manager's process
    group unchanged.

    Args:
        manager: the replica group's ``torchheal.Manager`` (anything with ``allreduce``,
            ``num_participants`` and ``_pg``).

    Raises:
        ValueError: the manager salvages steps (``salvage_step=True``): the collectives' callers
            (FSDP's gradient reduction) take the reduced values before the vote.
    """

    def __init__(self, manager: _ManagerLike) -> None:
        super().__init__()
        refuse_salvage(manager, type(self).__name__)
        self._manager = manager

    @property
    def manager(self) -> _ManagerLike:
        """The manager this group reduces through."""
        return self._manager

    def _inner(self) -> ProcessGroup:
        pg = self._manager._pg
        if pg is None:
            raise RuntimeError("ManagedProcessGroup: the manager has no process group")
        return pg

    # -- what goes through the manager ---------------------------------------------------

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp
    ) -> dist.Work:
        """Reduces one tensor across the participating replicas through the manager.

        Args:
            tensors: a list holding exactly one tensor, reduced in place (else ``ValueError``).
            opts: ``AllreduceOptions`` or a ``ReduceOp``.
        """
        if len(tensors) != 1:
            raise ValueError(
                f"ManagedProcessGroup.allreduce takes exactly one tensor, got {len(tensors)}"
            )
        return self._manager.allreduce(tensors[0], reduce_op=_reduce_op(opts))

    def size(self) -> int:
        """The number of replicas participating in the current step (0 before any quorum)."""
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        """The backend name of the manager's process group."""
        return self._inner().getBackendName()

    def errored(self) -> Exception | None:
        """The sticky error of the manager's process group, if any."""
        return self._inner().errored()

    def __repr__(self) -> str:
        return f"ManagedProcessGroup(pg={self._manager._pg!r})"

    # -- everything else goes straight to the manager's group ----------------------------

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **quorum: Any
    ) -> None:
        """Not supported: the manager reconfigures its own group on every new quorum."""
        raise RuntimeError(
            "ManagedProcessGroup is reconfigured by its manager; configure the manager's pg"
        )

    def _collective(self, name: str, *args: Any) -> dist.Work:
        return getattr(self._inner(), name)(*args)
