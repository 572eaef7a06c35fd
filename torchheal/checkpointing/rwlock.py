"""A reader-preferring readers/writer lock with bounded waits.

The reference's state-dict lock: readers serve a checkpoint, the training thread writes.
Every acquire is bounded by ``timeout`` (``TimeoutError``), so a stuck peer never hangs training.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RWLock:
    """Reader-preferring two-mutex readers/writer lock.

    Readers share the lock; a writer excludes everybody. New readers get in while a writer
    waits, so serving several healers at once is not starved by the trainer.

    Args:
        timeout: seconds every acquire waits before raising ``TimeoutError``; ``-1`` waits
            forever (the default).
    """

    def __init__(self, timeout: float = -1) -> None:
        if timeout is None or (timeout < 0 and timeout != -1):
            raise ValueError(f"RWLock timeout must be >= 0 seconds or -1, got {timeout!r}")
        self._timeout = float(timeout)
        # Guards the reader count; held only for a moment.
        self._readers_lock = threading.Lock()
        # Held by the writer, or for all readers while any is inside. Not an RLock: the last
        # reader out may not be the first one in.
        self._global = threading.Lock()
        self._readers = 0
        self._writer = False

    def r_acquire(self) -> None:
        """Acquires the lock for reading; raises ``TimeoutError`` after the timeout."""
        if not self._readers_lock.acquire(timeout=self._timeout):
            raise TimeoutError(f"Timed out waiting for rlock after {self._timeout} seconds")
        try:
            if self._readers == 0:
                # First reader in takes the global lock for every reader.
                if not self._global.acquire(timeout=self._timeout):
                    raise TimeoutError(f"Timed out waiting for rlock after {self._timeout} seconds")
            self._readers += 1
        finally:
            self._readers_lock.release()

    def r_release(self) -> None:
        """Releases a read hold taken by ``r_acquire``."""
        with self._readers_lock:
            if self._readers <= 0:
                raise RuntimeError("r_release called without a matching r_acquire")
            self._readers -= 1
            if self._readers == 0:
                self._global.release()

    @contextmanager
    def r_lock(self) -> Iterator[None]:
        """Context manager holding the lock for reading."""
        self.r_acquire()
        try:
            yield
        finally:
            self.r_release()

    def w_acquire(self) -> None:
        """Acquires the lock for writing; raises ``TimeoutError`` after the timeout."""
        if not self._global.acquire(timeout=self._timeout):
            raise TimeoutError(f"Timed out waiting for wlock after {self._timeout} seconds")
        self._writer = True

    def w_release(self) -> None:
        """Releases the write hold taken by ``w_acquire``."""
        if not self._writer:
            raise RuntimeError("w_release called without a matching w_acquire")
        self._writer = False
        self._global.release()

    @contextmanager
    def w_lock(self) -> Iterator[None]:
        """Context manager holding the lock for writing."""
        self.w_acquire()
        try:
            yield
        finally:
            self.w_release()

    def w_locked(self) -> bool:
        """Whether a writer holds the lock (readers holding it do not count)."""
        return self._writer
