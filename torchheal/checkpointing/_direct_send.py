"""Non-blocking sends on a connected socket, for sending straight from the trainer's tensors.

:class:`~torchheal.checkpointing.live.LiveCheckpoint` reads live memory only while the kernel
copies it into the socket, and must never wait for the reader meanwhile. A Python socket with a
timeout waits inside ``send`` when its buffer is full (it polls before every attempt), so the
sends go through a twin that never waits (a duplicate of the descriptor, non-blocking), and
:meth:`SocketDirectSend.ready` does the waiting, outside the read.
"""

from __future__ import annotations

import os
import select
import socket

__all__ = ["SocketDirectSend"]


class SocketDirectSend:
    """Non-blocking sends on ``sock`` and bounded waits for room (a ``DirectSend``).

    ``sock`` must have a timeout (its descriptor is then already non-blocking; a blocking one
    would turn non-blocking under its owner). ``timeout``: how long :meth:`ready` waits.
    """

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        if sock.gettimeout() is None:
            raise ValueError("SocketDirectSend needs a socket with a timeout")
        self._timeout = timeout
        self._twin = socket.socket(fileno=os.dup(sock.fileno()))
        self._twin.setblocking(False)
        self._poll = select.poll()
        self._poll.register(self._twin, select.POLLOUT)

    def ready(self) -> None:
        """Waits until the socket takes bytes (or has failed: the next send says how)."""
        if not self._poll.poll(self._timeout * 1000):
            raise TimeoutError(f"the reader took no bytes for {self._timeout} s")

    def send(self, data: memoryview) -> int:
        """Sends what the socket takes now; returns how many bytes (0 when it is full)."""
        try:
            return self._twin.send(data)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        """Closes the twin (the socket itself stays open)."""
        self._twin.close()

    def __enter__(self) -> SocketDirectSend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
