"""A single-member process group whose operations complete at once (absorbs DDP's broadcasts)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torchheal.process_group.base import ProcessGroup
from torchheal.process_group.work import _DummyWork


class _CountingWork(_DummyWork):
    """A completed work that counts ``wait``/``get_future`` calls on its group."""

    def __init__(self, pg: ProcessGroupDummy, result: object) -> None:
        super().__init__(result)
        self._pg = pg

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Counts the call and returns ``True``."""
        self._pg.wait_count += 1
        return True

    def get_future(self):
        """Counts the call and returns the completed future."""
        self._pg.get_future_count += 1
        return self.future_


class ProcessGroupDummy(ProcessGroup):
    """A world-size-1 group: reductions and broadcasts leave data unchanged, gathers copy.

    Lists of unequal length are paired as far as the shorter goes, as the reference does (a
    caller may take it for a bigger group: ``ManagedProcessGroup`` reports participants as size).

    Args:
        rank: must be 0.
        world: must be 1.
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        if rank != 0 or world != 1:
            raise ValueError(f"ProcessGroupDummy needs rank 0 and world 1, got {rank}/{world}")
        self._rank = rank
        self._world = world
        self.wait_count = 0
        self.get_future_count = 0
        self.configure_count = 0

    def _work(self, result: object) -> dist.Work:
        return _CountingWork(self, result)

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **quorum: Any
    ) -> None:
        """Counts the call; nothing to build."""
        self.configure_count += 1

    def set_timeout(self, timeout: timedelta) -> None:
        """Accepted and ignored (nothing can time out)."""

    def getBackendName(self) -> str:
        """``"torchft-dummy"``."""
        return "torchft-dummy"

    def size(self) -> int:
        """Always 1."""
        return self._world

    def allgather(self, output_tensors, input_tensor, opts) -> dist.Work:
        for outs, inp in zip(output_tensors, input_tensor, strict=False):
            for out in outs:
                out.copy_(inp)
        return self._work(output_tensors)

    def allgather_into_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        for out, inp in zip(output_tensors, input_tensors, strict=False):
            out.copy_(inp.reshape(out.shape))
        return self._work(output_tensors)

    def allreduce(self, tensors, opts) -> dist.Work:
        return self._work(tensors)

    def allreduce_coalesced(self, tensors, opts) -> dist.Work:
        return self._work(tensors)

    def alltoall_base(
        self, output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts
    ) -> dist.Work:
        output_buffer.copy_(input_buffer)
        return self._work([output_buffer])

    def barrier(self, opts) -> dist.Work:
        return self._work(None)

    def broadcast(self, tensor_list, opts) -> dist.Work:
        return self._work(tensor_list)

    def recv(self, tensors, src_rank, tag) -> dist.Work:
        return self._work(tensors)

    def send(self, tensors, dst_rank, tag) -> dist.Work:
        return self._work(tensors)

    def reduce_scatter(self, output_tensors, input_tensors, opts) -> dist.Work:
        for out, ins in zip(output_tensors, input_tensors, strict=False):
            out.copy_(ins[0])
        return self._work(output_tensors)

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        for out, inp in zip(output_tensors, input_tensors, strict=False):
            out.copy_(inp.reshape(out.shape))
        return self._work(output_tensors)
