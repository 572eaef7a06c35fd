"""A ``multiprocessing`` context whose "processes" are threads (``multiprocessing.dummy``).

Code written against ``multiprocessing.get_context(...)`` (``ctx.Process``, ``ctx.Pipe``,
``ctx.Queue``, ``ctx.Event``, ``ctx.Lock``) runs in one process with it, which makes child-process
designs (such as the baby process groups) debuggable and testable without spawning.
"""

from __future__ import annotations

import multiprocessing.dummy as _dummy
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["DummyContext", "get_context"]


class DummyContext:
    """The subset of a ``multiprocessing`` context that thread-based code needs.

    Args:
        method: ignored (accepted for signature compatibility with ``get_context``).
    """

    def __init__(self, method: object = None) -> None:
        self.method = method

    def Process(
        self,
        group: object = None,
        target: Callable[..., object] | None = None,
        name: str | None = None,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        daemon: bool | None = None,
    ) -> Any:
        """A thread with the ``Process`` interface (``start``, ``join``, ``is_alive``).

        Args:
            group: must be None, as for ``threading.Thread``.
            target: the callable to run.
            name: thread name.
            args: positional arguments of ``target``.
            kwargs: keyword arguments of ``target``.
            daemon: whether the thread is a daemon (None: inherit).
        """
        proc = _dummy.Process(group=group, target=target, name=name, args=args, kwargs=kwargs)
        if daemon is not None:
            proc.daemon = daemon
        return proc

    def Pipe(self, duplex: bool = True) -> tuple[Any, Any]:
        """A pair of connected in-process connections.

        Args:
            duplex: accepted for compatibility; the dummy pipe is always bidirectional.
        """
        return _dummy.Pipe(duplex)

    def Queue(self, maxsize: int = 0) -> Any:
        """A thread-safe queue.

        Args:
            maxsize: capacity (0 = unbounded).
        """
        return _dummy.Queue(maxsize)

    def Event(self) -> threading.Event:
        """A ``threading.Event``."""
        return _dummy.Event()

    def Lock(self) -> Any:
        """A ``threading.Lock``."""
        return _dummy.Lock()


def get_context(method: object = None) -> DummyContext:
    """Returns a :class:`DummyContext` (same call shape as ``multiprocessing.get_context``).

    Args:
        method: ignored.
    """
    return DummyContext(method)
