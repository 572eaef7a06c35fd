"""A raw gRPC-over-HTTP/2 call with every header and byte under the caller's control (h2).

The ``grpc`` client library only sends well-formed calls: it builds the ``grpc-timeout``
header itself, frames each message with a correct 5-byte prefix and refuses reserved metadata.
To feed a server absurd timeouts, wrong content types, unknown encodings or broken framing we
speak HTTP/2 ourselves with the ``h2`` state machine over a plain socket.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events
import h2.exceptions


@dataclass(frozen=True)
class RawResult:
    """What came back from a raw call.

    Args:
        http_status: the ``:status`` pseudo-header, or None when no headers arrived.
        grpc_status: the ``grpc-status`` value (trailers or trailers-only), or None.
        grpc_message: the ``grpc-message`` value ("" when absent).
        body: the response's DATA bytes (a framed message on success).
        reset: the stream or the connection was reset or closed without a status.
        still_open: the call's ``open_when`` became true while the stream was still open (the
            socket is then closed, ending the call).
    """

    http_status: int | None
    grpc_status: int | None
    grpc_message: str
    body: bytes
    reset: bool
    still_open: bool = False


# How often ``open_when`` is asked while the server is silent.
POLL_S = 0.005


def frame(message: bytes, compressed: bool = False) -> bytes:
    """The gRPC length-prefixed message framing: flag byte, 4-byte big-endian length, bytes."""
    return struct.pack(">BI", 1 if compressed else 0, len(message)) + message


def raw_call(
    addr: tuple[str, int],
    path: str,
    headers: list[tuple[str, str]],
    body: bytes,
    timeout: float = 5.0,
    open_when: Callable[[], bool] | None = None,
) -> RawResult:
    """One HTTP/2 POST on a fresh connection; returns the status however the server ends it.

    Args:
        addr: (host, port) of the gRPC server.
        path: the ``:path``, e.g. ``/torchft.LighthouseService/Heartbeat``.
        headers: regular headers after the pseudo-headers (content-type, te, grpc-timeout...).
        body: the raw DATA bytes (use :func:`frame` for a well-framed message).
        timeout: bound on the whole exchange.
        open_when: for a call the server may rightly keep open (a watch stream): polled every
            few milliseconds while no end of stream came; once true, the call is left with
            ``still_open`` (the server's own state says it took the call).

    Raises:
        TimeoutError: the server did not end the stream within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no Nagle stalls between frames
    try:
        # No outbound validation: hostile headers (a "te: gzip", odd names) must reach the server.
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding="utf-8",
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=False,
        )
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        pseudo = [(":method", "POST"), (":scheme", "http"), (":path", path)]
        pseudo.append((":authority", f"{addr[0]}:{addr[1]}"))
        conn.send_headers(stream, pseudo + headers, end_stream=not body)
        sock.sendall(conn.data_to_send())
        sent = 0
        status: int | None = None
        grpc_status: int | None = None
        message = ""
        data = bytearray()
        while True:
            # Send as much of the body as the peer's flow-control window allows.
            while sent < len(body):
                window = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
                if window <= 0:
                    break
                piece = body[sent : sent + window]
                sent += len(piece)
                conn.send_data(stream, piece, end_stream=sent == len(body))
            pending = conn.data_to_send()
            if pending:
                # (The whole time left: a recv's short poll timeout must not cut a send.)
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                sock.sendall(pending)
            if open_when is not None and open_when():
                return RawResult(status, grpc_status, message, bytes(data), False, True)
            left = deadline - time.monotonic()
            if left <= 0:  # the server keeps the stream open (its pings are no answer)
                raise TimeoutError(f"no end of stream within {timeout}s")
            sock.settimeout(left if open_when is None else min(left, POLL_S))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if open_when is None:
                    raise
                continue
            except OSError:  # reset by the peer
                return RawResult(status, grpc_status, message, bytes(data), True)
            if not chunk:
                return RawResult(status, grpc_status, message, bytes(data), True)
            try:
                events = conn.receive_data(chunk)
            except h2.exceptions.ProtocolError:
                return RawResult(status, grpc_status, message, bytes(data), True)
            for event in events:
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    for k, v in event.headers:
                        if k == ":status":
                            status = int(v)
                        elif k == "grpc-status":
                            grpc_status = int(v)
                        elif k == "grpc-message":
                            message = v
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamReset | h2.events.ConnectionTerminated):
                    return RawResult(status, grpc_status, message, bytes(data), True)
                if isinstance(event, h2.events.StreamEnded):
                    return RawResult(status, grpc_status, message, bytes(data), False)
    except h2.exceptions.ProtocolError:
        return RawResult(None, None, "", b"", True)
    finally:
        sock.close()
