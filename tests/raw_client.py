"""A raw TCP connection for the listeners' limit tests: it sends what it is told, never waits
to read, and notices when the server closes it (``tests/*/test_*limits*``, ``*strangers*``)."""

from __future__ import annotations

import errno
import socket


class RawClient:
    """A connection to ``127.0.0.1:port`` that sends ``data`` and then only reads what arrived.

    Args:
        port: the listener's port.
        data: bytes sent at once (a server that refuses at once may reset before the last).
        rcvbuf: the socket's receive buffer, set before connecting (the window a server fills).
    """

    def __init__(self, port: int, data: bytes = b"", rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.address = self.sock.getsockname()[:2]
        self.received = b""
        self.sent = 0
        self.closed_by_server = False
        if data:
            self.send(data)
        self.sock.settimeout(0)  # from now on reads only take what has arrived

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
            self.sent += len(data)
        except OSError:  # refused at once: the reset can beat the last bytes
            self.closed_by_server = True

    def arrived(self, data: bytes) -> None:
        """Takes what the server sent (subclasses parse it)."""
        self.received += data

    def ended(self) -> bool:
        """Whether the server has closed this connection (reads what arrived, never waits)."""
        while not self.closed_by_server:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return False
            except OSError as e:
                assert e.errno in (errno.ECONNRESET, errno.EPIPE), e
                data = b""
            if data:
                self.arrived(data)
            else:
                self.closed_by_server = True
        return True

    def close(self) -> None:
        self.sock.close()
