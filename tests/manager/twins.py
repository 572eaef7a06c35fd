"""In-memory twins of what the Manager's parts talk to: a checkpoint transport and a quorum.

:class:`MemoryTransport` moves state through the real wire format (``encode_bytes`` ->
``decode_bytes``) over a dict shared by the replicas of a test, so what a receiver gets is a
decoded copy, never the sender's objects.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torchheal.checkpointing.deserialization import decode_bytes
from torchheal.checkpointing.serialization import encode_bytes
from torchheal.checkpointing.transport import CheckpointTransport


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
