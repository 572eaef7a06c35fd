"""A pipe wrapper with bounded receives, for our own child processes that may die or hang."""

from __future__ import annotations

from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from torchheal._base.timeouts import to_seconds


class _MonitoredPipe:
    """Wraps one end of a ``multiprocessing.Pipe`` with timeouts and error passing."""

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe

    def send(self, obj: object) -> None:
        """Sends ``obj`` (an exception is raised by the receiver); OSError after :meth:`close`."""
        self._pipe.send(obj)

    def recv(self, timeout: timedelta | float | None = None) -> Any:
        """Receives one object, raising exceptions the peer sent (``TimeoutError`` after
        ``timeout``, ``EOFError`` when the peer closed)."""
        if timeout is not None:
            seconds = to_seconds(timeout)
            if not self._pipe.poll(seconds):
                # Worded as the reference's; its tests match this text.
                raise TimeoutError(f"pipe.recv() timed out after {seconds} seconds")
        out = self._pipe.recv()
        if isinstance(out, BaseException):
            raise out
        return out

    def close(self) -> None:
        """Closes this end of the pipe (idempotent)."""
        self._pipe.close()

    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._pipe.closed

    def fileno(self) -> int:
        """The underlying file descriptor (for ``multiprocessing.connection.wait``)."""
        return self._pipe.fileno()
