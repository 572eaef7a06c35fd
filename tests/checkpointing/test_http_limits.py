"""What a client can make the HTTP checkpoint server hold before its request has been read.

The server checks the token once a request's head is complete, and gives each connection a
thread, so the limits (``_http_limits.HttpLimits``) bound what anyone who reaches the port holds:
connections, a head's time and a head's bytes. The tests shrink the limits so that a handful of
raw connections on loopback cross them, give the transport a per-operation timeout far beyond
every test (so that only the limits close anything), and read the server's doing from the
clients' side: a connection the server closed reads its end, and the server's connection
threads are counted. Meanwhile a healer still fetches its checkpoint whole, and a transfer in
progress is never closed to make room.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.checkpointing.test_serialization import assert_same, sample_state
from tests.coordination_io.helpers import wait_until
from tests.raw_client import RawClient
from torchheal.checkpointing import HTTPTransport, _http_limits

TOKEN = "limits-token"
STEP = 5
TIMEOUT_S = 60.0  # each socket operation's: longer than any test, so only the limits close


def request(*extra: bytes) -> bytes:
    """A healer's complete request for the served step, with the token and ``extra`` headers."""
    lines = [
        b"GET /checkpoint/5/full HTTP/1.1",
        b"Host: x",
        b"Authorization: Bearer " + TOKEN.encode(),
    ]
    return b"\r\n".join([*lines, *extra]) + b"\r\n\r\n"


class Client(RawClient):
    """A raw connection to the checkpoint server."""


class Transfer(Client):
    """A healer's transfer that has begun (its answer's head arrived) and then stops reading."""

    def __init__(self, port: int) -> None:
        # A small window: the server fills it and waits, mid-transfer, until read.
        super().__init__(port, request(), rcvbuf=64 * 1024)
        self.sock.settimeout(10)
        while b"\r\n\r\n" not in self.received:
            data = self.sock.recv(65536)
            assert data, f"closed before answering: {self.received[:200]!r}"
            self.received += data
        head, _, self.body = self.received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head[:200]
        length = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
        self.length = int(length[0].split(b":")[1])
        assert len(self.body) < self.length, "the whole answer came at once: no transfer to hold"

    def finish(self) -> int:
        """Reads the rest of the answer; returns how many bytes of its body arrived."""
        got = len(self.body)
        while got < self.length:
            data = self.sock.recv(1 << 20)
            if not data:
                break
            got += len(data)
        return got


def server_threads() -> int:
    """The threads serving connections of ``ThreadingHTTPServer``\\ s in this process."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., HTTPTransport]]:
    """``serve(state, **limits)``: a transport serving ``state`` as step 5 under those limits."""
    made: list[HTTPTransport] = []

    def run(state: Any, **limits: Any) -> HTTPTransport:
        monkeypatch.setattr(_http_limits, "LIMITS", _http_limits.HttpLimits(**limits))
        transport: HTTPTransport = HTTPTransport(TIMEOUT_S, 0, token=TOKEN, hostname="127.0.0.1")
        made.append(transport)
        transport.send_checkpoint([1], STEP, state)
        return transport

    yield run
    for transport in made:
        transport.shutdown()


def fetch(source: HTTPTransport, num_chunks: int = 0) -> Any:
    """A healer's fetch of step 5 from ``source``."""
    healer: HTTPTransport = HTTPTransport(10.0, num_chunks, token=TOKEN, hostname="127.0.0.1")
    try:
        return healer.recv_checkpoint(0, source.metadata(), STEP)
    finally:
        healer.shutdown()


def test_slow_clients_hold_at_most_the_cap_and_a_healer_is_served(
    serve: Callable[..., HTTPTransport],
) -> None:
    state = sample_state()
    # A head deadline far off, so that nothing but the cap can close a connection here.
    source = serve(state, connections=8, head_s=300.0)
    port = source._server.server_port
    before = server_threads()
    partial = b"GET /checkpoint/5/full HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000
    # Accepted in order: each past the eighth closes the oldest.
    clients = [Client(port, partial if i % 2 else b"") for i in range(30)]
    wait_until(lambda: all(c.ended() for c in clients[:22]), 10, "the oldest to make room")
    assert not any(c.ended() for c in clients[22:])  # the cap is full, not over
    assert all(c.received == b"" for c in clients[:22])  # closed, not answered
    wait_until(lambda: server_threads() - before <= 8, 10, "the closed ones' threads to end")
    # A healer's four connections (metadata and three chunks) make room in turn.
    assert_same(fetch(source, num_chunks=3), state)
    wait_until(lambda: server_threads() - before <= 8, 10, "at most 8 threads after the fetch")
    for c in clients:
        c.close()


def test_a_trickling_client_is_closed_at_the_head_deadline(
    serve: Callable[..., HTTPTransport],
) -> None:
    state = sample_state()
    source = serve(state, head_s=1.0)
    port = source._server.server_port
    # A byte every 0.1 s keeps every read within the socket's timeout: only a deadline on the
    # whole head ends it. An idle connection beside it sends nothing at all.
    started = time.monotonic()  # before either connects: the server's clocks start later
    trickle = Client(port, b"GET /checkpoint/5/full HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    idle = Client(port)
    last = 0.0
    assert_same(fetch(source), state)  # served meanwhile

    def trickling_ended() -> bool:
        nonlocal last
        if not trickle.ended() and time.monotonic() - last >= 0.1:
            trickle.send(b"a")
            last = time.monotonic()
        return trickle.ended() and idle.ended()

    wait_until(trickling_ended, 10, "the server to close the trickling and idle clients")
    took = time.monotonic() - started
    assert 1.0 <= took < 5.0, took
    assert trickle.received == idle.received == b""  # closed, not answered
    assert_same(fetch(source), state)
    for c in (trickle, idle):
        c.close()


def test_a_head_over_the_byte_limit_is_refused(serve: Callable[..., HTTPTransport]) -> None:
    state = sample_state()
    source = serve(state, head_bytes=4096, head_s=300.0)
    port = source._server.server_port
    # Complete, with the token, but 6 KB of headers: answered 431, never served.
    pads = [b"X-Pad-%d: " % i + b"a" * 2000 for i in range(3)]
    large = Client(port, request(*pads))
    wait_until(large.ended, 10, "the server to answer a head over the limit")
    assert large.received.startswith(b"HTTP/1.1 431 "), large.received[:200]
    # A head that goes over the limit and never ends is not waited for.
    endless = Client(port, b"GET /checkpoint/5/full HTTP/1.1\r\nX-Pad: " + b"a" * 8000)
    wait_until(endless.ended, 10, "the server to close a head over the limit")
    assert endless.received.startswith(b"HTTP/1.1 431 "), endless.received[:200]
    assert_same(fetch(source), state)  # a healer's head (a few hundred bytes) is served
    for c in (large, endless):
        c.close()


def test_the_cap_never_closes_a_transfer_in_progress(serve: Callable[..., HTTPTransport]) -> None:
    # 32 MiB: far over what the socket buffers take, so each transfer waits on its healer.
    source = serve({"w": torch.ones(8 << 20)}, connections=3, head_s=300.0)
    port = source._server.server_port
    first, second = Transfer(port), Transfer(port)
    # Transfers do not count against the cap, only connections awaiting a head: three fit.
    idle = [Client(port) for _ in range(3)]
    newer = Client(port)  # the transfers are older, yet the oldest idle one makes room
    wait_until(idle[0].ended, 10, "the oldest connection awaiting a head to make room")
    assert not newer.ended() and not any(c.ended() for c in idle[1:])
    third = Transfer(port)  # a healer is let in, making room in turn
    wait_until(idle[1].ended, 10, "the next oldest connection awaiting a head to make room")
    for transfer in (first, second, third):
        assert transfer.finish() == transfer.length  # whole: never closed to make room
    for c in (first, second, third, *idle, newer):
        c.close()
