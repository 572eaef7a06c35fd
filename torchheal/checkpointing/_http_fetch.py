"""The healer's side of the HTTP checkpoint transport: fetch, verify, rebuild.

:func:`fetch` reads the description, then every storage's bytes straight into preallocated
buffers (or the healer's own tensors, ``into``), over one stream or ``num_chunks`` parallel
ones, checksumming each slice while it is still in cache. Nothing is returned unverified.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from torchheal.checkpointing._format import HEADER, split_chunks
from torchheal.checkpointing._http_errors import CheckpointHTTPError
from torchheal.checkpointing.deserialization import (
    Description,
    allocate_buffers,
    parse_description,
    parse_header,
    read_segments,
    rebuild,
)
from torchheal.checkpointing.timeline import mark
from torchheal.checkpointing.transport import CheckpointError, TornCheckpointError
from torchheal.coordination.rpc.auth import bearer
from torchheal.process_group.gloo_sockets import mark_foreign, unmark_foreign

__all__ = ["Aborts", "Client", "fetch"]


def fetch(client: Client, base: str, step: int, num_chunks: int, into: Any = None) -> Any:
    """Fetches, verifies and rebuilds the checkpoint of ``step`` under ``base`` (a URL path).

    Raises ``TornCheckpointError`` when the receive failed after bytes had landed in ``into``.
    """
    key = "full" if num_chunks == 0 else "metadata"
    with client.get(f"{base}/{key}") as resp:
        length, crc = parse_header(read_exact(resp, HEADER.size))
        desc = parse_description(read_exact(resp, length), crc)
        if desc.step != step:
            raise CheckpointError(f"received checkpoint for step {desc.step}, wanted {step}")
        data = desc.data_bytes if num_chunks == 0 else 0
        if resp.length is not None and resp.length != data:
            raise CheckpointError(
                f"checkpoint stream length mismatch: {resp.length} data bytes, "
                f"description says {data}"
            )
        buffers, used = allocate_buffers(desc, into)
        mark("fetch.data.begin", nbytes=desc.data_bytes, in_place=len(used))
        try:
            _read_data(client, base, resp, desc, buffers, num_chunks)
        except Exception as e:
            if not used:
                raise
            raise TornCheckpointError(
                f"receiving into this replica's own tensors failed part way ({e}): they "
                "hold a mix of old and unverified bytes until a later heal succeeds"
            ) from e
    mark("fetch.data.end")
    return rebuild(desc, buffers, used)


def _read_data(
    client: Client,
    base: str,
    resp: http.client.HTTPResponse,
    desc: Description,
    buffers: list[torch.Tensor],
    num_chunks: int,
) -> None:
    """Reads every storage's bytes into ``buffers`` and verifies them."""
    if num_chunks == 0:
        read_segments(resp.readinto, buffers, desc.segments)
        return
    chunks = split_chunks(desc.segments, num_chunks)

    def one(i: int) -> None:
        with client.get(f"{base}/{i}?n={num_chunks}") as chunk:
            want = sum(s.end - s.start for s in chunks[i])
            if chunk.length != want:
                raise CheckpointError(
                    f"checkpoint chunk {i} is {chunk.length} bytes, expected {want}"
                )
            read_segments(chunk.readinto, buffers, chunks[i])

    # Leaving the pool waits for every chunk, also on error: none writes into the buffers after.
    with ThreadPoolExecutor(num_chunks, thread_name_prefix="torchheal-fetch") as pool:
        for f in [pool.submit(one, i) for i in range(num_chunks)]:
            f.result()


class Aborts:
    """The connections of one receive, which :meth:`abort` ends at once (and any opened later).

    Each is marked foreign to Gloo until :meth:`close`: a fetch runs beside the build of the
    cross-replica group, whose abort must tell the group's connections from it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._inodes: list[int | None] = []
        self.aborted = False

    def add(self, sock: socket.socket) -> None:
        """Registers a connected socket; ends it at once if the receive was aborted."""
        inode = mark_foreign(sock)
        with self._lock:
            self._socks.append(sock)
            self._inodes.append(inode)
            if not self.aborted:
                return
        _end(sock)

    def close(self) -> None:
        """The receive is over: closes its connections and drops their foreign marks."""
        with self._lock:
            socks, self._socks = self._socks, []
            inodes, self._inodes = self._inodes, []
        for sock in socks:
            sock.close()
        for inode in inodes:
            unmark_foreign(inode)

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            socks = list(self._socks)
        for sock in socks:
            _end(sock)


def _end(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class Client:
    """One GET per connection, with the token and a socket timeout."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        token: str | None,
        context: ssl.SSLContext | None = None,
        aborts: Aborts | None = None,
    ) -> None:
        self._host, self._port, self._timeout, self._token = host, port, timeout, token
        self._context = context
        self._aborts = aborts

    def get(self, path: str) -> http.client.HTTPResponse:
        conn: http.client.HTTPConnection
        if self._context is not None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._context
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        headers = {"Authorization": bearer(self._token)} if self._token else {}
        if self._aborts is not None:
            conn.connect()
            assert conn.sock is not None
            self._aborts.add(conn.sock)
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            message = resp.read(4096).decode(errors="replace")
            resp.close()
            conn.close()
            raise CheckpointHTTPError(path, resp.status, message)
        return resp


def read_exact(resp: http.client.HTTPResponse, n: int) -> bytes:
    data = resp.read(n)
    if len(data) != n:
        raise CheckpointError(f"truncated checkpoint stream: got {len(data)} of {n} bytes")
    return data
