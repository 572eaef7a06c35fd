"""Timeouts on futures, CUDA streams and blocks of code.

One lazily started daemon thread runs the callback of each deadline not cancelled in time (a heap
under a condition variable). Callbacks must be short: one that never returns would disable every
timeout, so a watchdog exits the process ("TimeoutManager is stuck. Exiting.") when a callback
outlasts ``TORCHHEAL_WATCHDOG_TIMEOUT_SEC`` and the replica restarts instead of hanging. Unlike the
reference (whose ``sys.exit`` only ended the watchdog thread), that ends in ``os._exit(1)``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
from torch.futures import Future

from torchheal._base.manager_env import watchdog_timeout_s
from torchheal._base.timeouts import to_seconds

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TimerHandle:
    """A scheduled callback; :meth:`cancel` stops it from running if it has not run yet."""

    __slots__ = ("_callback", "cancelled", "deadline")

    def __init__(self, deadline: float, callback: Callable[[], None]) -> None:
        self.deadline = deadline
        self._callback: Callable[[], None] | None = callback
        self.cancelled = False

    def cancel(self) -> None:
        """Prevents the callback from running (no effect once it ran)."""
        self.cancelled = True
        # Drop the reference so a cancelled timer does not keep a process group alive.
        self._callback = None


def _exit_stuck() -> None:
    logger.critical("TimeoutManager is stuck. Exiting.")
    try:
        sys.exit(1)
    except SystemExit:
        # On this thread SystemExit would end the watchdog only, not the process.
        os._exit(1)


class _TimeoutManager:
    """One daemon thread running callbacks at deadlines; ``on_stuck`` when one outlasts
    ``watchdog_timeout`` (read from the environment when None)."""

    def __init__(
        self,
        watchdog_timeout: float | None = None,
        on_stuck: Callable[[], None] = _exit_stuck,
    ) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._watchdog_timeout = watchdog_timeout
        self._on_stuck = on_stuck
        # monotonic start time of the callback now running on the manager thread, if any
        self._running_since: float | None = None
        # Events recorded by stream_timeout are destroyed on a caller's thread, never on the
        # manager thread: destroying a CUDA event can block behind a hung stream.
        self._del_queue: deque[Any] = deque()

    def schedule(self, timeout: timedelta | float, callback: Callable[[], None]) -> TimerHandle:
        """Runs ``callback`` on the manager thread after ``timeout`` unless cancelled."""
        handle = TimerHandle(time.monotonic() + to_seconds(timeout), callback)
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="torchheal-TimeoutManager", daemon=True
                )
                self._thread.start()
            if self._watchdog is None:
                if self._watchdog_timeout is None:
                    self._watchdog_timeout = watchdog_timeout_s()
                self._watchdog = threading.Thread(
                    target=self._watch, name="torchheal-TimeoutWatchdog", daemon=True
                )
                self._watchdog.start()
            earliest = not self._heap or handle.deadline < self._heap[0][0]
            heapq.heappush(self._heap, (handle.deadline, next(self._seq), handle))
            if earliest:
                # Only an earlier deadline needs a wake-up (every collective schedules one).
                self._cond.notify()
        return handle

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    # Pop cancelled timers eagerly so they do not pin memory until their deadline.
                    while self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    delay = self._heap[0][0] - time.monotonic()
                    if delay <= 0:
                        _, _, handle = heapq.heappop(self._heap)
                        break
                    self._cond.wait(delay)
            callback = handle._callback
            handle.cancel()
            if callback is None:
                continue
            self._running_since = time.monotonic()
            try:
                callback()
            except Exception:
                logger.exception("timeout callback failed")
            finally:
                self._running_since = None

    @property
    def _watchdog_interval(self) -> timedelta:
        """The watchdog's limit as a ``timedelta`` (the reference's name; settable)."""
        if self._watchdog_timeout is None:
            self._watchdog_timeout = watchdog_timeout_s()
        return timedelta(seconds=self._watchdog_timeout)

    @_watchdog_interval.setter
    def _watchdog_interval(self, value: timedelta) -> None:
        self._watchdog_timeout = to_seconds(value)

    def _watch(self) -> None:
        tick = threading.Event()
        while True:
            # Read each round, so a limit set after the watchdog started applies.
            limit = self._watchdog_timeout
            assert limit is not None
            # Event.wait as an interruptible sleep; nothing ever sets it.
            tick.wait(limit / 4)
            since = self._running_since
            if since is not None and time.monotonic() - since > limit:
                self._on_stuck()
                return

    def pending(self) -> int:
        """Number of scheduled, not cancelled timers (for tests and diagnostics)."""
        with self._cond:
            return sum(1 for _, _, h in self._heap if not h.cancelled)

    def drain_deletions(self) -> None:
        """Drops events whose timers finished (runs on the caller's thread)."""
        while self._del_queue:
            try:
                self._del_queue.popleft()
            except IndexError:
                return


_TIMEOUT_MANAGER = _TimeoutManager()


def future_timeout(fut: Future[T], timeout: timedelta | float) -> Future[T]:
    """Returns a future with ``fut``'s outcome, or ``TimeoutError`` if it takes too long.

    Args:
        fut: the future to watch.
        timeout: how long before the returned future fails with ``TimeoutError``.
    """
    return timed_then(fut, timeout, _outcome)


def _outcome(fut: Future[T]) -> T:
    return fut.value()


class Expiry:
    """Ends a set of timed futures before their timeout, all at once, with one error.

    The Manager gives one to each configuration of its process group: when its quorum is over,
    pending collectives end now, not at their timeout (a Gloo receive may never be woken).
    Final: a future registered after :meth:`expire` ends at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._enders: dict[int, Callable[[BaseException], None]] | None = {}
        self._error: BaseException | None = None

    @property
    def expired(self) -> BaseException | None:
        """The error it expired with, or None."""
        return self._error

    def pending(self) -> int:
        """How many registered futures are still pending (for tests and diagnostics)."""
        with self._lock:
            return len(self._enders or ())

    def add(self, end: Callable[[BaseException], None]) -> int | None:
        """Registers ``end(error)`` (quick, never raising), called once on :meth:`expire`.

        Returns the key to :meth:`discard` it with (None: it was called already).
        """
        with self._lock:
            if self._enders is not None:
                key = next(self._ids)
                self._enders[key] = end
                return key
            error = self._error
        assert error is not None
        end(error)
        return None

    def discard(self, key: int | None) -> None:
        """Forgets a registered future (it settled on its own)."""
        if key is None:
            return
        with self._lock:
            if self._enders is not None:
                self._enders.pop(key, None)

    def expire(self, error: BaseException) -> int:
        """Ends every pending registered future with ``error`` (once); how many it ended."""
        with self._lock:
            enders, self._enders = self._enders, None
            if enders is None:
                return 0
            self._error = error
        for end in enders.values():
            try:
                end(error)
            except Exception:
                logger.exception("ending a future early failed")
        return len(enders)


def timed_then(
    fut: Future[Any],
    timeout: timedelta | float,
    fn: Callable[[Future[Any]], T],
    expiry: Expiry | None = None,
) -> Future[T]:
    """``future_timeout(fut, timeout).then(fn)`` in one callback (each callback takes the GIL).

    ``fn`` runs once and gets ``fut`` itself (tell it apart by identity), or a future failed with
    ``TimeoutError`` or with ``expiry``'s error; its exception reaches the returned future as is.
    """
    out: Future[T] = Future()
    lock = threading.Lock()
    done = False

    def _claim() -> bool:
        nonlocal done
        with lock:
            if done:
                return False
            done = True
            return True

    def _settle(source: Future[Any]) -> None:
        try:
            value = fn(source)
        except Exception as e:
            out.set_exception(e)
            return
        out.set_result(value)

    def _end(error: BaseException) -> None:
        if _claim():
            expired: Future[Any] = Future()
            expired.set_exception(error)
            _settle(expired)

    def _on_timeout() -> None:
        _end(TimeoutError(f"future did not complete within {timeout}"))

    handle = _TIMEOUT_MANAGER.schedule(timeout, _on_timeout)

    def _on_early_end(error: BaseException) -> None:
        handle.cancel()
        _end(error)

    key = expiry.add(_on_early_end) if expiry is not None else None

    def _on_done(_: Future[Any]) -> None:
        handle.cancel()
        if expiry is not None:
            expiry.discard(key)
        if _claim():
            _settle(fut)

    fut.add_done_callback(_on_done)
    return out


def future_wait(fut: Future[T], timeout: timedelta | float) -> T:
    """Blocks until ``fut`` completes and returns its value (``TimeoutError`` after ``timeout``).

    Args:
        fut: the future to wait on.
        timeout: the longest time to block.
    """
    if fut.done():
        return fut.wait()
    event = threading.Event()
    fut.add_done_callback(lambda _: event.set())
    if not event.wait(to_seconds(timeout)):
        raise TimeoutError(f"future did not complete within {timeout}")
    return fut.wait()


@contextmanager
def context_timeout(callback: Callable[[], None], timeout: timedelta | float) -> Generator[None]:
    """Calls ``callback`` (on the timeout thread) if the block is still running after ``timeout``.

    Args:
        callback: what to do on expiry, typically aborting a communicator so the block unblocks.
        timeout: how long the block may run.
    """
    handle = _TIMEOUT_MANAGER.schedule(timeout, callback)
    try:
        yield
    finally:
        handle.cancel()


class _Queryable(Protocol):
    def query(self) -> bool: ...


def stream_timeout(
    callback: Callable[[], None],
    timeout: timedelta | float,
    event: _Queryable | None = None,
) -> TimerHandle:
    """Calls ``callback`` if the current accelerator stream's queued work is not done in time.

    Without an accelerator nothing is scheduled unless ``event`` is given.

    Args:
        callback: what to do when the stream is late (typically ``pg.abort``).
        timeout: how long the stream may take.
        event: an already recorded event to watch (anything with ``query() -> bool``).
    """
    _TIMEOUT_MANAGER.drain_deletions()
    if event is None:
        if torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
        else:
            return TimerHandle(0.0, lambda: None)
    watched = event

    def _check() -> None:
        try:
            if not watched.query():
                callback()
        finally:
            _TIMEOUT_MANAGER._del_queue.append(watched)

    return _TIMEOUT_MANAGER.schedule(timeout, _check)
