"""The reconfigurable process group interface every torchheal process group implements.

A :class:`ProcessGroup` is a ``torch.distributed.ProcessGroup`` (so DDP, DeviceMesh and functional
collectives accept it) rebuilt in place by :meth:`ProcessGroup.configure`. Every collective routes
through :meth:`ProcessGroup._collective`, so a forwarding group overrides one method, not eleven.
"""

from __future__ import annotations

import inspect
import threading
from datetime import timedelta
from typing import Any

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


def quorum_group_name(
    quorum_id: int | None, group_rank: int | None, group_world_size: int | None
) -> str | None:
    """``torchft_{quorum_id}_rank_{group_rank % group_world_size}``, or None when a part is unknown.

    The same group rank of every replica group forms one cross-replica group, sharing the name.
    """
    if quorum_id is None or group_rank is None or not group_world_size:
        return None
    return f"torchft_{quorum_id}_rank_{group_rank % group_world_size}"


#: The collectives every process group offers, in the order the class defines them.
COLLECTIVES: tuple[str, ...] = (
    "allgather",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall_base",
    "barrier",
    "broadcast",
    "recv",
    "reduce_scatter",
    "reduce_scatter_tensor_coalesced",
    "send",
)

# Parameter names that hold lists of tensors, whatever the collective.
_LIST_PARAMETERS = frozenset(
    {"tensors", "tensor_list", "output_tensors", "input_tensor", "input_tensors"}
)


def allreduce_options(opts: AllreduceOptions | ReduceOp) -> AllreduceOptions:
    """Accepts options or a bare reduce op, as torch's own bindings do."""
    if isinstance(opts, AllreduceOptions):
        return opts
    out = AllreduceOptions()
    out.reduceOp = opts
    return out


def check_list_arguments(name: str, args: tuple[Any, ...]) -> None:
    """Raises ``TypeError`` when an argument that must be a list of tensors is not a list.

    A group that ships arguments elsewhere checks them first, so the mistake is reported at
    the call instead of inside a child process or a peer.
    """
    for param, value in zip(_PARAMETERS[name], args, strict=False):
        if param in _LIST_PARAMETERS and not isinstance(value, list):
            raise TypeError(f"{param} must be a list, got {type(value).__name__}")


def takes_options(name: str) -> bool:
    """Whether the collective's last argument is an options object (all but send/recv)."""
    return _PARAMETERS[name][-1] == "opts"


def accepts_quorum_keywords(pg: Any) -> bool:
    """Whether ``pg.configure`` takes the quorum keywords of :meth:`ProcessGroup.configure`.

    Groups written for the older four-argument ``configure`` get the keywords only if they do.
    """
    try:
        params = inspect.signature(pg.configure).parameters.values()
    except (TypeError, ValueError):
        return False
    names = {p.name for p in params}
    return any(p.kind is p.VAR_KEYWORD for p in params) or "quorum_id" in names


# Serialises register(): torch's backend registry and new_group are process-global.
_REGISTER_LOCK = threading.Lock()


class ProcessGroup(dist.ProcessGroup):
    """Base class of the reconfigurable process groups.

    The C++ base is built with rank 0 and size 1; subclasses report the real size through
    :meth:`size`. C++ code reading the size directly (stock DDP's parameter check) sees 1, so
    stock DDP works over these groups only as a world of 1; torchheal's DDP uses the Manager.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(0, 1)
        self._group_name: str | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        *,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Rebuilds the group on a store prefix never used before, blocking until it is usable.

        Groups that build a c10d backend name it after the quorum (:func:`quorum_group_name`).

        Args:
            store_addr: ``"host:port/prefix"`` of the rendezvous TCPStore.
            replica_id: this replica group's id (for logs and error records).
            rank: this process's rank in the new group.
            world_size: the number of members of the new group.
            quorum_id: the quorum this configuration is for.
            group_rank: this process's rank within its replica group.
            group_world_size: the number of ranks in a replica group.
            global_ranks: the global rank of each member of the new group, in rank order.

        Raises:
            RuntimeError or TimeoutError: if the group could not be formed within its timeout.
        """
        raise NotImplementedError("not implemented")

    def abort(self) -> None:
        """Aborts in-flight operations so blocked callers fail fast (no-op in the base)."""

    def abandon_configure(self) -> None:
        """Gives up the store connection of a :meth:`configure` in progress (any thread).

        A lost member may host the rendezvous store, frozen: the configure then fails at once
        instead of retrying until its timeout. A no-op when no configure is in progress.
        """

    def shutdown(self) -> None:
        """Releases the group's resources (no-op in the base)."""

    def errored(self) -> Exception | None:
        """The sticky error of the current configuration, or ``None``."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the timeout of subsequent operations."""
        raise NotImplementedError("not implemented")

    def getBackendName(self) -> str:
        """Name of the backend (``torchft-*`` for compatibility with the reference)."""
        raise NotImplementedError("not implemented")

    def size(self) -> int:
        """World size of the current configuration."""
        raise NotImplementedError("not implemented")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- collectives -----------------------------------------------------------------------

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensor: list[torch.Tensor],
        opts: AllgatherOptions,
    ) -> dist.Work:
        """Gathers ``input_tensor`` from every rank into ``output_tensors``.

        Args:
            output_tensors: one list of ``size()`` tensors per input tensor.
            input_tensor: the local tensors.
            opts: gather options.
        """
        return self._collective("allgather", output_tensors, input_tensor, opts)

    def allgather_into_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: AllgatherOptions,
    ) -> dist.Work:
        """Gathers each input into the matching flat output (``size()`` times larger).

        Args:
            output_tensors: flat outputs.
            input_tensors: local inputs.
            opts: gather options.
        """
        return self._collective(
            "allgather_into_tensor_coalesced", output_tensors, input_tensors, opts
        )

    def allreduce(
        self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp
    ) -> dist.Work:
        """Reduces ``tensors`` in place across ranks.

        Args:
            tensors: tensors reduced in place.
            opts: options or just the reduce op.
        """
        return self._collective("allreduce", tensors, allreduce_options(opts))

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: AllreduceCoalescedOptions
    ) -> dist.Work:
        """Reduces several tensors in place as one operation.

        Args:
            tensors: tensors reduced in place.
            opts: coalesced reduce options.
        """
        return self._collective("allreduce_coalesced", tensors, opts)

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: AllToAllOptions,
    ) -> dist.Work:
        """Scatters slices of ``input_buffer`` to every rank and gathers theirs.

        Args:
            output_buffer: receives the slices.
            input_buffer: holds the slices to send.
            output_split_sizes: slice sizes received (empty = equal).
            input_split_sizes: slice sizes sent (empty = equal).
            opts: all-to-all options.
        """
        return self._collective(
            "alltoall_base",
            output_buffer,
            input_buffer,
            output_split_sizes,
            input_split_sizes,
            opts,
        )

    def barrier(self, opts: BarrierOptions) -> dist.Work:
        """Waits until every rank reaches the barrier.

        Args:
            opts: barrier options.
        """
        return self._collective("barrier", opts)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: BroadcastOptions) -> dist.Work:
        """Copies the root's tensors to every rank.

        Args:
            tensor_list: tensors sent (root) or overwritten (others).
            opts: options naming the root rank.
        """
        return self._collective("broadcast", tensor_list, opts)

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcasts one tensor from ``root``.

        Args:
            tensor: the tensor sent or overwritten.
            root: the rank that sends.
        """
        opts = BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        """Receives ``tensors`` from ``src_rank``.

        Args:
            tensors: overwritten with the received data.
            src_rank: the sender.
            tag: message tag matching the sender's.
        """
        return self._collective("recv", tensors, src_rank, tag)

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: ReduceScatterOptions,
    ) -> dist.Work:
        """Reduces the inputs across ranks and leaves slice ``rank`` on each rank.

        Args:
            output_tensors: per-rank results.
            input_tensors: one list of ``size()`` tensors per output.
            opts: reduce-scatter options.
        """
        return self._collective("reduce_scatter", output_tensors, input_tensors, opts)

    def reduce_scatter_tensor_coalesced(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: ReduceScatterOptions,
    ) -> dist.Work:
        """Reduce-scatter of flat inputs (``size()`` times larger than outputs).

        Args:
            output_tensors: per-rank results.
            input_tensors: flat inputs.
            opts: reduce-scatter options.
        """
        return self._collective(
            "reduce_scatter_tensor_coalesced", output_tensors, input_tensors, opts
        )

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work:
        """Sends ``tensors`` to ``dst_rank``.

        Args:
            tensors: the data.
            dst_rank: the receiver.
            tag: message tag.
        """
        return self._collective("send", tensors, dst_rank, tag)

    def _collective(self, name: str, *args: Any) -> dist.Work:
        """Where every collective goes (``name`` from :data:`COLLECTIVES`, args in order)."""
        raise NotImplementedError("not implemented")

    # -- registration with torch.distributed -----------------------------------------------

    def register(self, name: str) -> dist.ProcessGroup:
        """Registers this group with ``torch.distributed`` so it can be resolved by name.

        Creates a backend ``"{getBackendName()}:{name}"`` whose factory returns ``self``, and a
        world-size-1 group over this rank, so DeviceMesh and functional collectives find it.
        Needs a default process group.

        Args:
            name: unique suffix of the backend name.
        """
        backend_name = f"{self.getBackendName()}:{name}"

        def _factory(*args: Any, **kwargs: Any) -> ProcessGroup:
            return self

        devices = ["cpu", "xpu"] if torch.xpu.is_available() else ["cpu", "cuda"]
        # The registry is global and re-registering a name replaces its factory: groups of one
        # process registering the same name take turns, or new_group calls another's factory.
        with _REGISTER_LOCK:
            dist.Backend.register_backend(backend_name, _factory, devices=devices)
            group = dist.new_group(
                ranks=[dist.get_rank()], backend=backend_name, group_desc=backend_name
            )
            if group is not self:
                raise RuntimeError(f"register({name!r}) did not return this process group")
            self._group_name = dist.distributed_c10d._world.pg_names[self]
        return group

    def unregister(self) -> None:
        """Undoes :meth:`register` (destroys the façade group)."""
        dist.destroy_process_group(self)
        self._group_name = None

    @property
    def group_name(self) -> str:
        """The name ``register`` gave this group in ``torch.distributed``."""
        if self._group_name is None:
            raise ValueError("ProcessGroup name not set (call register() first)")
        return self._group_name


# collective -> its parameter names after ``self``, read from the declarations above.
_PARAMETERS: dict[str, tuple[str, ...]] = {
    name: tuple(inspect.signature(getattr(ProcessGroup, name)).parameters)[1:]
    for name in COLLECTIVES
}
