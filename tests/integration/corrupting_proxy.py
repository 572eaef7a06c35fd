"""A TCP proxy that flips one byte of what the upstream server sends back: wire corruption.

Used by the end-to-end tests to corrupt a live-recovery transfer on a real socket, between the
healing replica and its source, without touching either side's code.
"""

from __future__ import annotations

import socket
import threading


class CorruptingProxy:
    """Listens on 127.0.0.1; forwards each connection to ``target``; flips byte ``offset`` of
    the first response that is long enough, then forwards faithfully.

    Args:
        target: (host, port) of the real server.
        offset: index, in the upstream-to-client byte stream, of the byte to flip.
    """

    def __init__(self, target: tuple[str, int], offset: int = 1500) -> None:
        self._target = target
        self._offset = offset
        self._flipped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="corrupting-proxy", daemon=True).start()

    @property
    def flipped(self) -> bool:
        """Whether a byte has been flipped yet."""
        return self._flipped.is_set()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target, timeout=30)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, corrupt: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if (
                    corrupt
                    and not self._flipped.is_set()
                    and seen <= self._offset < seen + len(data)
                ):
                    buf = bytearray(data)
                    buf[self._offset - seen] ^= 0xFF
                    data = bytes(buf)
                    self._flipped.set()
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
