"""Serving a checkpoint from the live state, with a copy made only of what is still to be sent.

A healthy replica's state does not change between the quorum that asks it to heal a peer and its
optimizer step, so its large storages are served from where they lie. Before the trainer changes
them (``disallow_checkpoint``), :meth:`LiveCheckpoint.freeze` copies only the blocks the expected
healers have not received yet, so a heal never makes the source wait on a socket.

A live block that changed since staging fails its CRC check, ends the transfer and makes
:attr:`LiveCheckpoint.unstable` switch the transport to private copies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from torchheal.checkpointing._format import Segment, byte_view, crc32
from torchheal.checkpointing.serialization import StagedCheckpoint, StagingPool
from torchheal.checkpointing.transport import CheckpointError

__all__ = ["LIVE_FROM_BYTES", "DirectSend", "LiveCheckpoint"]

logger = logging.getLogger(__name__)

#: Storages of at least this size are served live; smaller ones are copied at staging (cheap, and
#: small tensors are the ones a forward pass may update: norm statistics).
LIVE_FROM_BYTES = 1 << 20


class DirectSend(Protocol):
    """A connection that takes bytes straight from memory without blocking (a TCP socket)."""

    def ready(self) -> None:
        """Waits until the connection takes bytes again; ``TimeoutError`` if the reader stopped."""

    def send(self, data: memoryview) -> int:
        """Sends what the connection takes now, without waiting; returns how many bytes."""


class LiveCheckpoint:
    """A staged checkpoint whose large storages are the trainer's own, until :meth:`freeze`.

    ``readers``: healers expected to fetch each block; a block delivered that many times is
    not copied by the freeze. ``freeze_wait``: how long the freeze waits for reads in flight.
    """

    def __init__(
        self,
        staged: StagedCheckpoint,
        readers: int,
        pool: StagingPool,
        freeze_wait: float = 60.0,
    ) -> None:
        self.staged = staged
        self._readers = max(1, readers)
        self._pool = pool
        self._freeze_wait = freeze_wait
        self._index = {seg: i for i, seg in enumerate(staged.segments)}
        self._views = [byte_view(b) for b in staged.buffers]
        self._cond = threading.Condition()
        self._delivered = [0] * len(staged.segments)
        self._copied = [False] * len(staged.segments)
        self._block_bytes = max((s.end - s.start for s in staged.segments), default=0)
        # The freeze's copies, by segment index: one block-sized pool buffer each.
        self._copies: dict[int, torch.Tensor] = {}
        self._copy_views: dict[int, memoryview] = {}
        self._live_reads = 0
        self._frozen = False
        self._requests = 0  # requests reading this checkpoint (open_request .. close_request)
        self._retired = False
        self._released = False
        #: A live block changed before it was sent: stage private copies from now on.
        self.unstable = False
        #: Bytes the freeze copied (0 when every healer was done before it).
        self.copied_bytes = 0

    @property
    def step(self) -> int:
        """The step the state belongs to."""
        return self.staged.step

    @property
    def frozen(self) -> bool:
        """The live state is no longer read (:meth:`freeze` has returned)."""
        return self._frozen

    def write(
        self,
        write: Callable[[memoryview], object],
        segments: Sequence[Segment],
        direct: DirectSend | None = None,
    ) -> None:
        """Sends ``segments`` (of ``staged.segments``), in order, through ``write``.

        Live blocks go straight from the state through ``direct`` (the same connection's
        non-blocking sends) when given, else through a bounce buffer. Raises
        ``CheckpointError`` when a live block changed or is no longer served.
        """
        bounce: torch.Tensor | None = None
        for seg in segments:
            i = self._index[seg]
            if not self.staged.live[seg.storage]:
                write(self._views[seg.storage][seg.start : seg.end])
            elif direct is not None:
                self._send_direct(i, seg, write, direct)
            else:
                n = seg.end - seg.start
                with self._reading(i, seg) as live:
                    if live:
                        if bounce is None:
                            bounce = self._pool.take(self._block_bytes)
                        bounce[:n].copy_(self.staged.buffers[seg.storage][seg.start : seg.end])
                        data = byte_view(bounce)[:n]
                if not live:
                    # Copied by the freeze (and checked as it was copied).
                    write(self._copy_views[i])
                else:
                    if crc32(data) != seg.crc:
                        self._changed(seg)
                    write(data)
            with self._cond:
                self._delivered[i] += 1
        if bounce is not None:
            self._pool.give_back([bounce])

    def _send_direct(
        self, i: int, seg: Segment, write: Callable[[memoryview], object], direct: DirectSend
    ) -> None:
        """Sends live block ``i`` straight from the state, the rest from the freeze's copy.

        Each non-blocking ``send`` is one live read; the wait for room is outside it.
        """
        view = self._views[seg.storage]
        pos, crc = seg.start, 0
        while pos < seg.end:
            direct.ready()
            with self._reading(i, seg) as live:
                if live:
                    n = direct.send(view[pos : seg.end])
                    crc = crc32(view[pos : pos + n], crc)  # what the kernel just copied, in cache
            if not live:
                # Frozen mid-block: the rest comes from the copy (checked as it was copied).
                rest = self._copy_views[i][pos - seg.start :]
                write(rest)
                crc = crc32(rest, crc)
                break
            pos += n
        if crc != seg.crc:
            self._changed(seg)

    @contextlib.contextmanager
    def _reading(self, i: int, seg: Segment) -> Iterator[bool]:
        """One read of live block ``i``, which the freeze waits for.

        Yields True while the live state may be read, False when the freeze has copied the block.
        """
        with self._cond:
            if self._copied[i]:
                live = False
            elif self._frozen:
                raise CheckpointError(
                    f"checkpoint block [{seg.start}, {seg.end}) of storage {seg.storage} is no "
                    "longer served (the state has changed)"
                )
            else:
                self._live_reads += 1
                live = True
        try:
            yield live
        finally:
            if live:
                with self._cond:
                    self._live_reads -= 1
                    self._cond.notify_all()

    def _changed(self, seg: Segment) -> None:
        self._mark_unstable(seg)
        raise CheckpointError(
            f"checkpoint block [{seg.start}, {seg.end}) of storage {seg.storage} changed while "
            "it was served"
        )

    def _mark_unstable(self, seg: Segment) -> None:
        """A live storage changed before the optimizer step: copy everything from now on."""
        if not self.unstable:
            logger.warning(
                "a storage of %d bytes changed while it was served live (a large tensor updated "
                "outside the optimizer step?): this heal fails, and this replica stages private "
                "copies of its state from now on",
                self.staged.buffers[seg.storage].numel(),
            )
        self.unstable = True

    def freeze(self) -> None:
        """Training thread, before the state changes: copies what is not yet delivered.

        Returns once the live state is no longer read (no live read in flight). Idempotent.
        """
        if self._frozen:
            return
        segments = self.staged.segments
        # From the end of the stream: a healer receiving from the front meanwhile may finish
        # blocks before they need copying.
        for i in reversed(range(len(segments))):
            seg = segments[i]
            if not self.staged.live[seg.storage]:
                continue
            with self._cond:
                if self._delivered[i] >= self._readers:
                    continue
            n = seg.end - seg.start
            # A block-sized buffer per block still to send, not one per storage: faulting in a
            # storage-sized buffer for a few of its blocks costs the trainer far more.
            copy = self._pool.take(self._block_bytes)
            copy[:n].copy_(self.staged.buffers[seg.storage][seg.start : seg.end])
            view = byte_view(copy)[:n]
            if crc32(view) != seg.crc:
                self._mark_unstable(seg)
            self.copied_bytes += n
            with self._cond:
                self._copies[i], self._copy_views[i] = copy, view
                self._copied[i] = True
        with self._cond:
            self._frozen = True
            if not self._cond.wait_for(lambda: self._live_reads == 0, self._freeze_wait):
                raise CheckpointError(
                    f"a copy of the live state was still in flight after {self._freeze_wait} s"
                )

    @property
    def requests(self) -> int:
        """Requests reading this checkpoint now."""
        with self._cond:
            return self._requests

    def open_request(self) -> None:
        """A request starts reading this checkpoint; ``CheckpointError`` once it is retired."""
        with self._cond:
            if self._retired:
                raise CheckpointError(f"checkpoint of step {self.step} is no longer served")
            self._requests += 1

    def close_request(self) -> None:
        """A request ended; the last one of a retired checkpoint gives its buffers back."""
        with self._cond:
            self._requests -= 1
            last = self._retired and self._requests == 0
        if last:
            self.release()

    def retire(self) -> None:
        """No request opens this checkpoint any more; its buffers go back to the pool when the
        last request reading it ends. Freezes first if a request still reads the live state."""
        with self._cond:
            self._retired = True
            busy = self._requests > 0
        if busy and not self._frozen:
            self.freeze()
        with self._cond:
            last = self._requests == 0
        if last:
            self.release()

    def release(self) -> None:
        """Gives the private buffers back to the pool (idempotent)."""
        with self._cond:
            if self._released:
                return
            self._released = True
        self._pool.give_back(self.staged.private)
        self._pool.give_back(list(self._copies.values()))
        self._copies.clear()
        self._copy_views.clear()
