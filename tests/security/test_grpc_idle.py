"""gRPC servers close connections that say nothing: no handshake, or no call.

Anyone who reaches a gRPC port (token or not: the token is checked per call) could otherwise
keep connections open forever. ``rpc.server.SERVER_OPTIONS`` bounds both; the test runs a
server with those options, their times divided by 20, and sees the server close a connection
that never sends the HTTP/2 preface and one that sends a frame it never finishes.
"""

from __future__ import annotations

import select
import socket
import time

from torchheal._base.security import SecurityEnv
from torchheal.coordination.rpc.server import SERVER_OPTIONS, AioServerThread

BOUNDS = ("grpc.server_handshake_timeout_ms", "grpc.max_connection_idle_ms")
# The client's preface, its SETTINGS, and the ACK of the server's: a client that does not
# acknowledge them is closed after 60 s whatever the options.
PREFACE = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
)
# A HEADERS frame announced at 16 KiB, cut short.
PARTIAL = (16384).to_bytes(3, "big") + b"\x01\x04\x00\x00\x00\x01" + b"\x00" * 8000


def _closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed ``sock`` (reading what it sends), or None."""
    start = time.monotonic()
    deadline = start + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - start
            except ConnectionResetError:
                return time.monotonic() - start
    return None


def test_connections_without_a_handshake_or_a_call_are_closed() -> None:
    names = dict(SERVER_OPTIONS)
    assert all(name in names for name in BOUNDS), names
    options = [(k, v // 20 if k in BOUNDS else v) for k, v in SERVER_OPTIONS]
    handshake_s = names[BOUNDS[0]] / 20 / 1000
    idle_s = names[BOUNDS[1]] / 20 / 1000
    server = AioServerThread(
        "idle-test", "127.0.0.1:0", {}, options=options, security=SecurityEnv()
    )
    try:
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        partial = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        partial.sendall(PREFACE + PARTIAL)
        took = _closed_within(silent, handshake_s + 10)
        assert took is not None, "a connection that never sent the preface stayed open"
        took = _closed_within(partial, idle_s + 10)
        assert took is not None, "a connection that never made a call stayed open"
        silent.close()
        partial.close()
    finally:
        server.shutdown()
