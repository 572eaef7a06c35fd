"""``ManagedProcessGroup``: the cross-replica dimension of a device mesh, driven by a Manager.

FSDP2's HSDP gradient all-reduce, DeviceMesh and functional collectives all talk to a
``torch.distributed.ProcessGroup``. This class is that group for the replicate dimension: its
all-reduce goes through ``Manager.allreduce`` (fault tolerant, averaged over the replicas that
participate in this step), its size is the number of participants, and every other collective
goes straight to the manager's reconfigurable process group.

The manager is duck-typed (``allreduce``, ``num_participants``, ``_pg``) so this module never
imports ``torchheal.manager`` (the manager sits above the process groups).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceOp,
    ReduceScatterOptions,
)

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
    """

    def __init__(self, manager: _ManagerLike) -> None:
        super().__init__()
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
            tensors: a list holding exactly one tensor, reduced in place.
            opts: ``AllreduceOptions`` or a ``ReduceOp``.

        Raises:
            ValueError: if ``tensors`` does not hold exactly one tensor.
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
        """Not supported: the manager reconfigures its own group on every new quorum.

        Args:
            store_addr: unused.
            replica_id: unused.
            rank: unused.
            world_size: unused.
            quorum: unused.
        """
        raise RuntimeError(
            "ManagedProcessGroup is reconfigured by its manager; configure the manager's pg"
        )

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensor: list[torch.Tensor],
        opts: AllgatherOptions,
    ) -> dist.Work:
        """See :meth:`ProcessGroup.allgather`; issued on the manager's group.

        Args:
            output_tensors: one list of ``size()`` tensors per input tensor.
            input_tensor: the local tensors.
            opts: gather options.
        """
        return self._inner().allgather(output_tensors, input_tensor, opts)

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions,
    ) -> dist.Work:
        """See :meth:`ProcessGroup.allgather_into_tensor_coalesced`; on the manager's group.

        Args:
            output_tensors: flat outputs.
            input_tensors: local inputs.
            opts: gather options.
        """
        return self._inner().allgather_into_tensor_coalesced(output_tensors, input_tensors, opts)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
    ) -> dist.Work:
        """See :meth:`ProcessGroup.allreduce_coalesced`; on the manager's group (not managed).

        Args:
            tensors: tensors reduced in place.
            opts: coalesced reduce options.
        """
        return self._inner().allreduce_coalesced(tensors, opts)

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        """See :meth:`ProcessGroup.alltoall_base`; on the manager's group.

        Args:
            output_buffer: receives the slices.
            input_buffer: holds the slices to send.
            output_split_sizes: slice sizes received.
            input_split_sizes: slice sizes sent.
            opts: all-to-all options.
        """
        return self._inner().alltoall_base(
            output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts
        )

    def barrier(self, opts: BarrierOptions) -> dist.Work:
        """See :meth:`ProcessGroup.barrier`; on the manager's group.

        Args:
            opts: barrier options.
        """
        return self._inner().barrier(opts)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        """See :meth:`ProcessGroup.broadcast`; on the manager's group.

        Args:
            tensor_list: tensors sent (root) or overwritten (others).
            opts: options naming the root rank.
        """
        return self._inner().broadcast(tensor_list, opts)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        """See :meth:`ProcessGroup.recv`; on the manager's group.

        Args:
            tensors: overwritten with the received data.
            src_rank: the sender.
            tag: message tag.
        """
        return self._inner().recv(tensors, src_rank, tag)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions,
    ) -> dist.Work:
        """See :meth:`ProcessGroup.reduce_scatter`; on the manager's group.

        Args:
            output_tensors: per-rank results.
            input_tensors: one list of ``size()`` tensors per output.
            opts: reduce-scatter options.
        """
        return self._inner().reduce_scatter(output_tensors, input_tensors, opts)

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions,
    ) -> dist.Work:
        """See :meth:`ProcessGroup.reduce_scatter_tensor_coalesced`; on the manager's group.

        Args:
            output_tensors: per-rank results.
            input_tensors: flat inputs.
            opts: reduce-scatter options.
        """
        return self._inner().reduce_scatter_tensor_coalesced(output_tensors, input_tensors, opts)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work:
        """See :meth:`ProcessGroup.send`; on the manager's group.

        Args:
            tensors: the data.
            dst_rank: the receiver.
            tag: message tag.
        """
        return self._inner().send(tensors, dst_rank, tag)
