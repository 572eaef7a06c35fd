"""Small ``torch.distributed.Work`` implementations shared by the process groups and the Manager."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.futures import Future


def _chain(fut: Future[Any], fn: Callable[[Future[Any]], Any]) -> Future[Any]:
    """Like ``fut.then(fn)`` but an exception raised by ``fn`` reaches the new future as is
    (``Future.then`` wraps it in a generic ``RuntimeError``)."""
    out: Future[Any] = Future()

    def _done(f: Future[Any]) -> None:
        try:
            value = fn(f)
        except Exception as e:
            out.set_exception(e)
            return
        out.set_result(value)

    fut.add_done_callback(_done)
    return out


class _DummyWork(dist.Work):
    """A work already done, its future resolved to ``result``."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self.result_ = result
        self.future_: Future[object] = Future()
        self.future_.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Returns ``True`` at once."""
        return True

    def get_future(self) -> Future[object]:
        """A completed future holding ``result``."""
        return self.future_


class _ErrorRecordingWork(dist.Work):
    """Wraps a work so failures are reported to ``on_error`` before they reach the caller.

    Wrapping a recording work whose future nobody asked for yet adopts its reporters instead of
    nesting: each layer of Python callbacks takes the GIL on the thread completing the collective.
    """

    def __init__(self, work: dist.Work, on_error: Callable[[Exception], None]) -> None:
        super().__init__()
        reporters: tuple[Callable[[Exception], None], ...] = (on_error,)
        if isinstance(work, _ErrorRecordingWork) and work._fut is None:
            # Innermost reporter first, as the nested chain would have called them.
            reporters = (*work._reporters, on_error)
            work = work._work
        self._work = work
        self._reporters = reporters
        self._fut: Future[Any] | None = None

    def _on_error(self, e: Exception) -> None:
        for report in self._reporters:
            report(e)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits on the inner work; a failure is reported, then re-raised."""
        try:
            if timeout is None:
                return self._work.wait()
            return self._work.wait(timeout)
        except Exception as e:
            self._on_error(e)
            raise

    def get_future(self) -> Future[Any]:
        """The inner future chained through the error reporter (same value or exception)."""
        if self._fut is None:
            on_error = self._on_error

            def _check(fut: Future[Any]) -> Any:
                try:
                    return fut.value()
                except Exception as e:
                    on_error(e)
                    raise

            self._fut = _chain(self._work.get_future(), _check)
        return self._fut

    def take_future(self) -> tuple[Future[Any], Callable[[Exception], None]]:
        """The inner future unchecked, and the reporter its failure must be passed to.

        For a caller that checks the outcome in its own callback anyway (the Manager's buckets):
        one callback instead of two. :meth:`get_future` then returns the same unchecked future.
        """
        if self._fut is not None:
            # Already chained through the reporter: the caller's check must not report again.
            return self._fut, _ignore
        self._fut = self._work.get_future()
        return self._fut, self._on_error

    def is_completed(self) -> bool:
        """Whether the inner work finished."""
        return self._work.is_completed()


def _ignore(e: Exception) -> None:
    pass


class _FailedWork(dist.Work):
    """A work for an operation that raised ``error`` when it was issued."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Raises the stored error."""
        raise self._error

    def get_future(self) -> Future[Any]:
        """A future already failed with the stored error."""
        fut: Future[Any] = Future()
        fut.set_exception(self._error)
        return fut
