"""A pipe wrapper with bounded receives, used to talk to child processes that may die or hang.

The peer is always one of our own child processes (the baby process groups), so objects are
pickled over a local pipe exactly as :mod:`multiprocessing` does; nothing here crosses the network.
"""

from __future__ import annotations

from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from torchheal._base.timeouts import to_seconds


class _MonitoredPipe:
    """Wraps a :class:`multiprocessing.connection.Connection` with timeouts and error passing.

    Args:
        pipe: one end of a ``multiprocessing.Pipe``.
    """

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe

    def send(self, obj: object) -> None:
        """Sends ``obj``; raises ``OSError("handle is closed")`` after :meth:`close`.

        Args:
            obj: any picklable object (an exception object is re-raised by the receiver).
        """
        self._pipe.send(obj)

    def recv(self, timeout: timedelta | float | None = None) -> Any:
        """Receives one object; exceptions sent by the peer are raised here.

        Args:
            timeout: the longest time to wait (``None`` waits forever). On expiry raises
                ``TimeoutError("pipe.recv() timed out after {t} seconds")``. A closed peer raises
                ``EOFError``.
        """
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
