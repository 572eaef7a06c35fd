"""Serving the live state with copy on write: what a healer gets is what was sent, whenever the
trainer changes its state, and the trainer copies only what is still to be sent."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from tests.checkpointing.test_serialization import assert_same
from torchheal.checkpointing import CheckpointError, HTTPTransport
from torchheal.checkpointing.live import LiveCheckpoint
from torchheal.checkpointing.serialization import StagingPool, decode_bytes, stage

BLOCK = 1 << 16
LIVE_FROM = 1 << 16
TIMEOUT = timedelta(seconds=10)


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(5 * BLOCK // 4),  # 5 blocks, served live
        "m": torch.randn(3 * BLOCK // 4 + 7),  # 4 blocks (a short last one), served live
        "small": torch.arange(10.0),  # copied at staging
        "step": 4,
    }


def _clone(state: dict[str, object]) -> dict[str, object]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _live(
    state: dict[str, object], readers: int = 1, pool: StagingPool | None = None
) -> LiveCheckpoint:
    staged = stage(state, 3, block_bytes=BLOCK, pool=StagingPool(), live_from=LIVE_FROM)
    assert staged.live.count(True) == 2  # "w" and "m"; "small" is a private copy
    return LiveCheckpoint(staged, readers, pool or StagingPool(), freeze_wait=10.0)


def _receive(live: LiveCheckpoint) -> bytes:
    """A healer's whole stream."""
    parts = bytearray(live.staged.header + live.staged.description)
    live.write(parts.extend, live.staged.segments)
    return bytes(parts)


class _Held:
    """A healer that receives ``first`` blocks, then waits until released."""

    def __init__(self, live: LiveCheckpoint, first: int) -> None:
        self.live = live
        self.parts = bytearray(live.staged.header + live.staged.description)
        self.error: BaseException | None = None
        self.paused = threading.Event()
        self.resume = threading.Event()
        self._count = 0
        self._first = first
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.paused.wait(10)

    def _write(self, data: memoryview) -> None:
        if self._count == self._first:
            self.paused.set()
            assert self.resume.wait(10)
        self.parts.extend(data)
        self._count += 1

    def _run(self) -> None:
        try:
            self.live.write(self._write, self.live.staged.segments)
        except BaseException as e:
            self.error = e
            self.paused.set()

    def finish(self) -> bytes:
        self.resume.set()
        self.thread.join(10)
        if self.error is not None:
            raise self.error
        return bytes(self.parts)


def test_a_heal_done_before_the_freeze_costs_the_trainer_no_copy() -> None:
    state = _state()
    sent = _clone(state)
    live = _live(state)
    stream = _receive(live)
    live.freeze()
    assert live.copied_bytes == 0
    assert_same(decode_bytes(stream), sent)
    # Nothing is read from the state once it may change: a late reader of a block every
    # expected healer already had is refused, not served what the optimizer wrote.
    for t in (state["w"], state["m"]):
        t.fill_(-1.0)
    with pytest.raises(CheckpointError, match="no longer served"):
        _receive(live)


def test_the_freeze_copies_only_what_is_still_to_be_sent() -> None:
    state = _state()
    sent = _clone(state)
    pool = StagingPool()
    live = _live(state, pool=pool)
    # Stream order: "w" (5 blocks), "m" (4 blocks), then "small". Held after 6 blocks.
    healer = _Held(live, first=6)
    live.freeze()  # should_commit, with the healer mid-transfer
    assert live.copied_bytes == state["m"].numel() * 4 - BLOCK  # m's last 3 blocks
    for t in (state["w"], state["m"], state["small"]):
        t.fill_(-1.0)  # the optimizer step
    assert_same(decode_bytes(healer.finish()), sent)
    live.release()
    # One block-sized buffer per block copied, not one the size of the storage (a large
    # storage's buffer, faulted in for a few blocks, once cost the trainer 0.76 s at 1 GB);
    # besides them, the healer's bounce buffer and the staged copy of "small".
    assert pool.nbytes == 3 * BLOCK + BLOCK + state["small"].numel() * 4


def test_a_healer_that_has_not_started_gets_the_state_as_sent() -> None:
    state = _state()
    sent = _clone(state)
    live = _live(state, readers=2)
    first = _receive(live)
    live.freeze()  # the second healer has not asked yet: everything live is copied
    assert live.copied_bytes == (state["w"].numel() + state["m"].numel()) * 4
    for t in (state["w"], state["m"]):
        t.fill_(-1.0)
    second = _receive(live)
    assert_same(decode_bytes(first), sent)
    assert_same(decode_bytes(second), sent)


def test_a_live_block_that_changed_is_never_sent() -> None:
    state = _state()
    live = _live(state)
    healer = _Held(live, first=2)
    state["w"].add_(1.0)  # a forward pass updating a large buffer in place
    with pytest.raises(CheckpointError, match="changed while it was served"):
        healer.finish()
    assert live.unstable
    # The block in hand when the healer paused was read before the change; the next is not sent.
    assert len(healer.parts) == len(live.staged.header + live.staged.description) + 3 * BLOCK


def test_http_stages_copies_after_a_live_storage_changed() -> None:
    src = HTTPTransport(TIMEOUT, 0, hostname="localhost", block_bytes=BLOCK)
    dst = HTTPTransport(TIMEOUT, 0, hostname="localhost")
    try:
        state = {**_state(), "w": torch.randn((2 << 20) // 4)}  # over LIVE_FROM_BYTES
        src.send_checkpoint([1], 1, state, TIMEOUT)
        assert src._staged.live == (True, False, False)
        state["w"].add_(1.0)  # changed after staging, before any optimizer step
        with pytest.raises(CheckpointError):
            dst.recv_checkpoint(0, src.metadata(), 1, TIMEOUT)
        src.disallow_checkpoint()
        # From now on this replica copies its whole state when it sends it.
        src.send_checkpoint([1], 2, state, TIMEOUT)
        assert not any(src._staged.live)
        sent = _clone(state)
        state["w"].add_(1.0)
        assert_same(dst.recv_checkpoint(0, src.metadata(), 2, TIMEOUT), sent)
    finally:
        src.shutdown()
        dst.shutdown()


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_http_healer_mid_transfer_at_the_optimizer_step(num_chunks: int) -> None:
    """End to end: the source freezes and changes its state while the healer downloads."""
    src = HTTPTransport(TIMEOUT, num_chunks, hostname="localhost", block_bytes=BLOCK)
    dst = HTTPTransport(TIMEOUT, num_chunks, hostname="localhost")
    try:
        state = {"w": torch.randn((16 << 20) // 4)}  # 16 MB: more than the socket buffers hold
        sent = _clone(state)
        src.send_checkpoint([1], 5, state, TIMEOUT)
        assert src._staged.live == (True,)
        got: dict[str, object] = {}
        healer = threading.Thread(
            target=lambda: got.update(dst.recv_checkpoint(0, src.metadata(), 5, TIMEOUT))
        )
        healer.start()
        src.disallow_checkpoint()
        state["w"].fill_(-1.0)
        healer.join(30)
        assert_same(got, sent)
    finally:
        src.shutdown()
        dst.shutdown()
