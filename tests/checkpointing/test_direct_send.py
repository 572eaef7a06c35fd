"""Sending live blocks straight from the state (no bounce copy) and checking blocks as they
arrive: what a healer gets is still what was staged, and the freeze never waits for a healer
that stopped reading."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch

from tests.checkpointing.test_live import BLOCK, _clone, _live, _state
from tests.checkpointing.test_serialization import assert_same
from torchheal.checkpointing import CheckpointError, HTTPTransport
from torchheal.checkpointing._direct_send import SocketDirectSend
from torchheal.checkpointing.deserialization import READ_SLICE_BYTES, read_segments
from torchheal.checkpointing.live import LiveCheckpoint
from torchheal.checkpointing.serialization import (
    StagingPool,
    allocate_buffers,
    decode_bytes,
    parse_description,
    stage,
)

TIMEOUT = timedelta(seconds=10)


class _Trickle:
    """A healer's connection that takes at most ``most`` bytes per send, and nothing on every
    third call (a full socket buffer); ``pause_after`` bytes in, :meth:`ready` blocks until
    :attr:`resume` is set."""

    def __init__(self, most: int, pause_after: int | None = None) -> None:
        self.parts = bytearray()
        self.most = most
        self.calls = 0
        self.pause_after = pause_after
        self.paused = threading.Event()
        self.resume = threading.Event()

    def write(self, data: memoryview) -> None:
        self.parts.extend(data)

    def ready(self) -> None:
        if self.pause_after is not None and len(self.parts) >= self.pause_after:
            self.pause_after = None
            self.paused.set()
            assert self.resume.wait(10)

    def send(self, data: memoryview) -> int:
        self.calls += 1
        if self.calls % 3 == 0:
            return 0
        n = min(self.most, len(data))
        self.parts.extend(data[:n])
        return n


def _stream(live: LiveCheckpoint, sink: _Trickle) -> bytes:
    sink.parts.extend(live.staged.header + live.staged.description)
    live.write(sink.write, live.staged.segments, sink)
    return bytes(sink.parts)


def test_partial_sends_deliver_the_staged_state() -> None:
    state = _state()
    sent = _clone(state)
    live = _live(state)
    assert_same(decode_bytes(_stream(live, _Trickle(most=5000))), sent)
    live.freeze()
    assert live.copied_bytes == 0  # every block was delivered before the freeze


def test_a_freeze_mid_block_does_not_wait_for_the_healer() -> None:
    state = _state()
    sent = _clone(state)
    live = _live(state)
    head = len(live.staged.header + live.staged.description)
    # Paused in the middle of "w"'s third block, waiting for room in its connection.
    sink = _Trickle(most=10_000, pause_after=head + 2 * BLOCK + 20_000)
    out: list[bytes] = []
    healer = threading.Thread(target=lambda: out.append(_stream(live, sink)))
    healer.start()
    assert sink.paused.wait(10)
    live.freeze()  # returns with the healer still paused: it holds no live read
    # The block in progress and everything after it were copied.
    assert live.copied_bytes == (state["w"].numel() + state["m"].numel()) * 4 - 2 * BLOCK
    for t in (state["w"], state["m"], state["small"]):
        t.fill_(-1.0)  # the optimizer step
    sink.resume.set()
    healer.join(10)
    assert_same(decode_bytes(out[0]), sent)


def test_a_changed_live_block_fails_both_ends() -> None:
    state = _state()
    live = _live(state)
    head = len(live.staged.header + live.staged.description)
    sink = _Trickle(most=10_000, pause_after=head + BLOCK + 100)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _stream(live, sink)
        except BaseException as e:
            errors.append(e)

    healer = threading.Thread(target=run)
    healer.start()
    assert sink.paused.wait(10)
    state["w"].add_(1.0)  # a forward pass updating a large buffer in place
    sink.resume.set()
    healer.join(10)
    assert "changed while it was served" in str(errors[0])
    assert live.unstable
    # The changed block's bytes left, and the healer's own check refuses them.
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        _read(live, bytes(sink.parts) + bytes(live.staged.data_bytes))


def _read(live: LiveCheckpoint, stream: bytes, chunk: int = 1 << 30) -> list[torch.Tensor]:
    """A healer's receive of ``stream`` (read ``chunk`` bytes at a time at most)."""
    head = len(live.staged.header + live.staged.description)
    desc = parse_description(live.staged.description)
    buffers, _ = allocate_buffers(desc, None)
    pos = head

    def readinto(out: memoryview) -> int:
        nonlocal pos
        n = min(len(out), chunk, len(stream) - pos)
        out[:n] = stream[pos : pos + n]
        pos += n
        return n

    read_segments(readinto, buffers, desc.segments)
    return buffers


@pytest.mark.parametrize("chunk", [1 << 30, 70_001])
def test_blocks_larger_than_a_read_are_checked_as_they_arrive(chunk: int) -> None:
    block = 2 * READ_SLICE_BYTES + 4096  # three slices per block
    state = {"w": torch.randn(3 * block // 4)}
    staged = stage(state, 1, block_bytes=block)
    live = LiveCheckpoint(staged, 1, StagingPool())
    stream = bytearray(staged.header + staged.description)
    for seg in staged.segments:
        stream.extend(memoryview(staged.buffers[seg.storage].numpy())[seg.start : seg.end])
    buffers = _read(live, bytes(stream), chunk)
    assert torch.equal(buffers[0].view(torch.float32), state["w"])
    stream[len(stream) - block - READ_SLICE_BYTES - 5] ^= 0x10  # second block, second slice
    with pytest.raises(CheckpointError, match=r"checksum mismatch in storage 0 bytes \["):
        _read(live, bytes(stream), chunk)


def test_socket_direct_send_never_waits_inside_send() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        with SocketDirectSend(a, timeout=0.2) as direct:
            direct.ready()
            data = memoryview(bytes(1 << 20))
            total = 0
            while (n := direct.send(data)) > 0:  # a full buffer takes nothing, at once
                total += n
            assert total > 0
            with pytest.raises(TimeoutError, match="took no bytes"):
                direct.ready()
            got = 0
            while got < total:
                got += len(b.recv(1 << 20))
            direct.ready()  # room again
        a.sendall(b"!")  # the socket itself stays open and usable
        assert b.recv(1) == b"!"
        b.settimeout(None)
        with pytest.raises(ValueError, match="timeout"):
            SocketDirectSend(b, timeout=1)


def test_http_source_freezes_while_a_healer_has_stopped_reading() -> None:
    """A healer that stops reading mid-block (a frozen process) holds the source's optimizer
    step for no time: the freeze copies the rest, and the healer later gets the staged state."""
    src = HTTPTransport(TIMEOUT, 0, hostname="localhost", block_bytes=4 << 20)
    try:
        state = {"w": torch.randn((32 << 20) // 4)}  # 32 MB: more than the socket buffers hold
        sent = _clone(state)
        src.send_checkpoint([1], 7, state, TIMEOUT)
        assert src._staged is not None and src._staged.live == (True,)
        with socket.create_connection(("localhost", src._server.server_port), timeout=10) as c:
            c.sendall(b"GET /checkpoint/7/full HTTP/1.0\r\n\r\n")
            first = c.recv(1 << 16)
            assert first.startswith(b"HTTP/1.0 200")
            src.disallow_checkpoint()  # the healer reads nothing meanwhile
            state["w"].fill_(-1.0)
            chunks = [first]
            while data := c.recv(1 << 20):
                chunks.append(data)
        response = b"".join(chunks)
        body = response[response.index(b"\r\n\r\n") + 4 :]
        assert_same(decode_bytes(body), sent)
    finally:
        src.shutdown()


def test_http_two_healers_at_once_through_the_freeze() -> None:
    """Two healers download the same live state at once (sends straight from it interleave
    with each other and with the freeze); both get the state as staged."""
    src = HTTPTransport(TIMEOUT, 0, hostname="localhost", block_bytes=1 << 20)
    healers = [HTTPTransport(TIMEOUT, 0, hostname="localhost") for _ in range(2)]
    try:
        state = {"w": torch.randn((24 << 20) // 4), "b": torch.randn((8 << 20) // 4)}
        sent = _clone(state)
        src.send_checkpoint([1, 2], 3, state, TIMEOUT)
        assert src._staged is not None and src._staged.live == (True, True)
        got: list[dict[str, object]] = [{}, {}]
        threads = [
            threading.Thread(
                target=lambda i=i: got[i].update(
                    healers[i].recv_checkpoint(0, src.metadata(), 3, TIMEOUT)
                )
            )
            for i in range(2)
        ]
        for t in threads:
            t.start()
        src.disallow_checkpoint()
        for t in state.values():
            t.fill_(-1.0)
        for t in threads:
            t.join(30)
        assert_same(got[0], sent)
        assert_same(got[1], sent)
    finally:
        src.shutdown()
        for h in healers:
            h.shutdown()
