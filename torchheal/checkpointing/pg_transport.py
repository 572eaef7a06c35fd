"""Process-group checkpoint transport: stream the state over a (cross-replica) PG.

Wire protocol, per destination rank (tags are the PG's point-to-point tags):

* tag 1: an ``int64`` tensor ``[description length, CRC-32 of the description]``;
* tag 2: the JSON description as a ``uint8`` tensor (see ``serialization``);
* tag 3: the storages of at most ``_SMALL_BYTES`` bytes packed into one message (see
  ``_packed_layout``), when there are any: thousands of scalars and biases cost one message;
* tag ``4 + i``: the raw bytes of each larger storage ``i``.

Unlike the reference, nothing is pickled, and every block is verified before anything is
returned or written into a template's tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch

from torchheal.checkpointing._format import MAX_DESCRIPTION_BYTES, Segment
from torchheal.checkpointing._verify import BlockVerifier
from torchheal.checkpointing.serialization import (
    DEFAULT_BLOCK_BYTES,
    allocate_buffers,
    byte_view,
    parse_description,
    rebuild,
    stage,
)
from torchheal.checkpointing.transport import (
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointTransport,
)

T = TypeVar("T")

_TAG_LENGTH = 1
_TAG_DESCRIPTION = 2
_TAG_PACKED = 3
_TAG_DATA = 4
_SMALL_BYTES = 1 << 20
_ALIGN = 64


def _packed_layout(nbytes: Sequence[int]) -> tuple[dict[int, int], int]:
    """Offsets (64-byte aligned) of the small storages in the packed message, and its size."""
    offsets: dict[int, int] = {}
    pos = 0
    for i, n in enumerate(nbytes):
        if 0 < n <= _SMALL_BYTES:
            offsets[i] = pos
            pos += -(-n // _ALIGN) * _ALIGN
    return offsets, pos


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
        pg: a ``ProcessGroup``-like object whose ranks are the quorum's replica ranks.
        timeout: bound on each individual wait.
        device: where tensors travel (``cpu`` for gloo); received tensors end up on CPU.
        state_dict: optional callable returning a template state dict, whose matching tensors
            are filled in place once every block has been verified.
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
        """Sends ``state_dict`` for ``step`` to every PG rank in ``dst_ranks``."""
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
        offsets, packed_bytes = _packed_layout([b.numel() for b in staged.buffers])
        if packed_bytes:
            packed = torch.zeros(packed_bytes, dtype=torch.uint8)
            for i, off in offsets.items():
                packed[off : off + staged.buffers[i].numel()].copy_(staged.buffers[i])
            moved = packed.to(self._device)
            for dst in dst_ranks:
                pending.append((self._pg.send([moved], dst, _TAG_PACKED), "send small storages"))
        for i, buf in enumerate(staged.buffers):
            if buf.numel() == 0 or i in offsets:
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
        """Receives the checkpoint of ``step`` from PG rank ``src_rank`` (``metadata`` ignored)."""
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
        targets, used = allocate_buffers(desc, template, self._device)
        offsets, packed_bytes = _packed_layout(desc.storage_nbytes)
        # A template's storage is the caller's live tensor: a large one arrives in a staging
        # buffer and is copied in after verification.
        buffers = [
            torch.empty_like(t) if i not in offsets and _is_template(t, used) else t
            for i, t in enumerate(targets)
        ]
        works: list[tuple[Any, int | None]] = []
        # A short Gloo message completes a longer receive unnoticed; zeroed, the bytes it did
        # not carry are never an earlier transfer's (the block checks judge them).
        packed = torch.zeros(packed_bytes, dtype=torch.uint8, device=self._device)
        if packed_bytes:
            works.append((self._pg.recv([packed], src_rank, _TAG_PACKED), None))
        works += [
            (self._pg.recv([buf], src_rank, _TAG_DATA + i), i)
            for i, buf in enumerate(buffers)
            if buf.numel() and i not in offsets
        ]
        blocks: list[list[Segment]] = [[] for _ in buffers]
        for seg in desc.segments:
            blocks[seg.storage].append(seg)
        cpu = list(buffers)
        packed_cpu = packed
        # Each message is checked on worker threads while the next ones arrive.
        with BlockVerifier() as verifier:
            for work, i in works:
                what = "small storages" if i is None else f"storage {i}"
                _wait(work, timeout, f"checkpoint {what} recv")
                if i is None:
                    packed_cpu = packed.cpu()
                    view = byte_view(packed_cpu)
                    verifier.submit_batch(
                        [
                            (view[off : off + desc.storage_nbytes[s]], seg)
                            for s, off in offsets.items()
                            for seg in blocks[s]
                        ]
                    )
                    continue
                if cpu[i].device.type != "cpu":
                    cpu[i] = cpu[i].cpu()
                view = byte_view(cpu[i])
                for seg in blocks[i]:
                    verifier.submit(view, seg)
        for s, off in offsets.items():  # verified: unpack (into templates too)
            buffers[s].copy_(packed[off : off + desc.storage_nbytes[s]])
            cpu[s] = buffers[s] if buffers[s].device.type == "cpu" else buffers[s].cpu()
        for target, staged in zip(targets, buffers, strict=True):
            if target is not staged:  # verified: fill the template
                target.copy_(staged)
        # Fresh device buffers move to CPU (as the reference); in-place targets stay put.
        final = [t if _is_template(t, used) else c for t, c in zip(targets, cpu, strict=True)]
        return rebuild(desc, final, used)


def _is_template(buf: torch.Tensor, used: dict[int, Any]) -> bool:
    ptr = buf.untyped_storage().data_ptr()
    return any(_local(t).untyped_storage().data_ptr() == ptr for t in used.values())


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
