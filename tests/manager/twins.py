"""In-memory twins of what the Manager's parts talk to: a checkpoint transport, a quorum, and a
process group whose collectives end when the test says.

:class:`MemoryTransport` moves state through the real wire format (``encode_bytes`` ->
``decode_bytes``) over a dict shared by the replicas of a test, so what a receiver gets is a
decoded copy, never the sender's objects.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from torchheal.checkpointing.deserialization import decode_bytes
from torchheal.checkpointing.serialization import encode_bytes
from torchheal.checkpointing.transport import CheckpointTransport
from torchheal.process_group.dummy import ProcessGroupDummy


class MemoryTransport(CheckpointTransport[Any]):
    """A checkpoint transport over a shared dict: ``(sender name, step) -> encoded bytes``.

    Args:
        network: the dict all replicas of a test share.
        name: this replica's name (its ``metadata()``).
    """

    def __init__(self, network: dict[tuple[str, int], bytes], name: str) -> None:
        self.network = network
        self.name = name
        self.sent: list[tuple[list[int], int]] = []
        self.received: list[tuple[int, str, int]] = []

    def metadata(self) -> str:
        return self.name

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        self.sent.append((list(dst_ranks), step))
        self.network[(self.name, step)] = encode_bytes(state_dict, step)

    def disallow_checkpoint(self) -> None:
        for key in [k for k in self.network if k[0] == self.name]:
            del self.network[key]

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.received.append((src_rank, metadata, step))
        try:
            data = self.network[(metadata, step)]
        except KeyError:
            raise RuntimeError(f"nothing served by {metadata!r} for step {step}") from None
        return decode_bytes(data)

    def shutdown(self, wait: bool = True) -> None:
        self.disallow_checkpoint()


class PendingWork(torch.distributed.Work):
    """A collective's work that ends with ``future``."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self.future = future

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.future.wait()
        return True


class PendingGroup(ProcessGroupDummy):
    """A process group whose allreduces complete when the test says so (or never: a peer that
    does not answer, and whose connection's end does not wake the collective either)."""

    def __init__(self) -> None:
        super().__init__()
        self.issued: list[tuple[torch.futures.Future, list[torch.Tensor]]] = []

    def allreduce(self, tensors, opts):  # type: ignore[no-untyped-def, override]
        future: torch.futures.Future = torch.futures.Future()
        self.issued.append((future, tensors))
        return PendingWork(future)
