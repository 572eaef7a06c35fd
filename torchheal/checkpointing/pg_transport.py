"""Process-group checkpoint transport: stream the state over a (cross-replica) PG.

Wire protocol, per destination rank (tags are the PG's point-to-point tags):

* tag 1: an ``int64`` tensor ``[description length, CRC-32 of the description]``;
* tag 2: the JSON description as a ``uint8`` tensor (see ``serialization``);
* tag ``3 + i``: the raw bytes of storage ``i`` (empty storages are not sent).

Unlike the reference, nothing is pickled: the receiver parses and validates the description,
receives every storage into a preallocated buffer (a template tensor's own storage when a
``state_dict`` template fits: in place) and verifies every block's CRC before returning.
Every wait is bounded by the timeout.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from torchheal.checkpointing._format import MAX_DESCRIPTION_BYTES
from torchheal.checkpointing.serialization import (
    DEFAULT_BLOCK_BYTES,
    allocate_buffers,
    byte_view,
    parse_description,
    rebuild,
    stage,
    verify_buffers,
)
from torchheal.checkpointing.transport import (
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointTransport,
)

T = TypeVar("T")

_TAG_LENGTH = 1
_TAG_DESCRIPTION = 2
_TAG_DATA = 3


def _wait(work: Any, timeout: timedelta, what: str) -> None:
    """Waits for a PG ``Work`` within ``timeout``; converts failures to ``CheckpointError``."""
    try:
        done = work.wait(timeout)
    except Exception as e:  # broad: any PG failure is this transfer's failure
        text = str(e)
        if any(w in text.lower() for w in ("timed out", "timeout", "time out")):
            raise CheckpointTimeoutError(f"{what} timed out after {timeout}: {text}") from e
        raise CheckpointError(f"{what} failed: {text}") from e
    if done is False:
        raise CheckpointTimeoutError(f"{what} timed out after {timeout}")


class PGTransport(CheckpointTransport[T]):
    """Sends checkpoints over a process group with point-to-point send/recv.

    Args:
        pg: a ``torch.distributed.ProcessGroup``-like object (``send``/``recv`` returning
            ``Work``); ranks are this PG's ranks (the replica ranks from the quorum).
        timeout: bound on each individual wait.
        device: where tensors travel (``cpu`` for gloo); received tensors without an
            in-place target end up on CPU.
        state_dict: optional callable returning a template state dict; tensors at the same
            key path with the same dtype, device type and storage size are received into in
            place. If verification then fails they hold garbage and a ``CheckpointError`` is
            raised: the caller must fail the step (the replica is still healing).
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        device: torch.device | str,
        state_dict: Callable[[], T] | None = None,
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        self._pg = pg
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._device = torch.device(device)
        self._state_dict = state_dict
        self._block_bytes = block_bytes

    def metadata(self) -> str:
        """Nothing to publish: the PG and the quorum's ranks identify the peers."""
        return "<n/a>"

    def disallow_checkpoint(self) -> None:
        """No-op: sends complete before ``send_checkpoint`` returns."""

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Sends ``state_dict`` for ``step`` to every rank in ``dst_ranks``.

        Args:
            dst_ranks: PG ranks to send to.
            step: the step of the state.
            state_dict: the state to send.
            timeout: bound on each wait; defaults to the constructor's.

        Raises:
            CheckpointError: unsupported value, PG failure or timeout.
        """
        timeout = self._timeout if timeout is None else timeout
        staged = stage(state_dict, step, block_bytes=self._block_bytes)
        desc = torch.frombuffer(bytearray(staged.description), dtype=torch.uint8)
        head = torch.tensor([len(staged.description), zlib.crc32(staged.description)])
        pending: list[tuple[Any, str]] = []
        for dst in dst_ranks:
            pending.append(
                (self._pg.send([head.to(self._device)], dst, _TAG_LENGTH), "send length")
            )
            pending.append(
                (self._pg.send([desc.to(self._device)], dst, _TAG_DESCRIPTION), "send description")
            )
        for i, buf in enumerate(staged.buffers):
            if buf.numel() == 0:
                continue
            moved = buf.to(self._device)
            for dst in dst_ranks:
                pending.append((self._pg.send([moved], dst, _TAG_DATA + i), f"send storage {i}"))
            if moved is not buf:
                # Device copies are transient: bound the memory to one storage at a time.
                for work, what in pending:
                    _wait(work, timeout, f"checkpoint {what} for step {step}")
                pending.clear()
        for work, what in pending:
            _wait(work, timeout, f"checkpoint {what} for step {step}")

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None
    ) -> T:
        """Receives the checkpoint of ``step`` from PG rank ``src_rank``.

        Args:
            src_rank: the sender's PG rank.
            metadata: ignored (``"<n/a>"``).
            step: the expected step.
            timeout: bound on each wait; defaults to the constructor's.

        Raises:
            CheckpointTimeoutError: a wait timed out.
            CheckpointError: wrong step, malformed description, checksum mismatch, PG failure.
        """
        timeout = self._timeout if timeout is None else timeout
        head = torch.zeros(2, dtype=torch.int64, device=self._device)
        _wait(self._pg.recv([head], src_rank, _TAG_LENGTH), timeout, "checkpoint length recv")
        length, crc = (int(v) for v in head.cpu().tolist())
        if not 0 < length <= MAX_DESCRIPTION_BYTES:
            raise CheckpointError(f"invalid checkpoint description length {length}")
        desc_t = torch.empty(length, dtype=torch.uint8, device=self._device)
        _wait(
            self._pg.recv([desc_t], src_rank, _TAG_DESCRIPTION),
            timeout,
            "checkpoint description recv",
        )
        desc = parse_description(bytes(byte_view(desc_t.cpu())), crc)
        if desc.step != step:
            raise CheckpointError(f"received checkpoint for step {desc.step}, wanted step {step}")
        template = self._state_dict() if self._state_dict is not None else None
        buffers, used = allocate_buffers(desc, template, self._device)
        works = [
            (self._pg.recv([buf], src_rank, _TAG_DATA + i), i)
            for i, buf in enumerate(buffers)
            if buf.numel()
        ]
        for work, i in works:
            _wait(work, timeout, f"checkpoint storage {i} recv")
        cpu = [b if b.device.type == "cpu" else b.cpu() for b in buffers]
        verify_buffers(cpu, desc.segments)
        # Fresh device buffers move to CPU (as the reference); in-place targets stay put.
        final = [b if _is_template(b, used) else c for b, c in zip(buffers, cpu, strict=True)]
        return rebuild(desc, final, used)


def _is_template(buf: torch.Tensor, used: dict[int, Any]) -> bool:
    ptr = buf.untyped_storage().data_ptr()
    return any(_local(t).untyped_storage().data_ptr() == ptr for t in used.values())


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
