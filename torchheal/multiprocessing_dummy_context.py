"""A ``multiprocessing`` context whose "processes" are threads (``multiprocessing.dummy``).

Child-process designs (the baby process groups) can then be debugged and tested without spawning.
"""

from __future__ import annotations

import multiprocessing.dummy as _dummy
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["DummyContext", "get_context"]


class DummyContext:
    """The subset of a ``multiprocessing`` context that thread-based code needs (``method``
    is ignored)."""

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
        """A thread with the ``Process`` interface (``start``, ``join``, ``is_alive``)."""
        proc = _dummy.Process(group=group, target=target, name=name, args=args, kwargs=kwargs)
        if daemon is not None:
            proc.daemon = daemon
        return proc

    def Pipe(self, duplex: bool = True) -> tuple[Any, Any]:
        """A pair of connected in-process connections (always bidirectional)."""
        return _dummy.Pipe(duplex)

    def Queue(self, maxsize: int = 0) -> Any:
        """A thread-safe queue (``maxsize`` 0: unbounded)."""
        return _dummy.Queue(maxsize)

    def Event(self) -> threading.Event:
        """A ``threading.Event``."""
        return _dummy.Event()

    def Lock(self) -> Any:
        """A ``threading.Lock``."""
        return _dummy.Lock()


def get_context(method: object = None) -> DummyContext:
    """Returns a :class:`DummyContext` (same call shape as ``multiprocessing.get_context``)."""
    return DummyContext(method)
