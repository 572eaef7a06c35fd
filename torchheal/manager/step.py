"""One step's failures and the work the vote must wait for.

The Manager promises that a failure anywhere in a step (the quorum thread's reconfiguration or
transfer, a collective, a wrapped future) makes this rank vote against committing it.
:class:`StepLedger` is where that is remembered: the step's error, and the collectives and
wrapped futures issued during the step, so that ``should_commit`` first waits for the ones
nobody waited on (a late error must not slip past the vote). It knows nothing about quorums,
process groups or transports, so it is tested with plain objects.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["ExceptionWithTraceback", "StepLedger"]


class ExceptionWithTraceback(Exception):
    """An error reported during a step, with the stack trace where it happened.

    Args:
        e: the original exception.
    """

    def __init__(self, e: Exception) -> None:
        self.original_exception = e
        if e.__traceback__ is not None:
            self.stack_trace: str = "".join(traceback.format_exception(e))
        else:
            # Reported without being raised: the caller's stack says where.
            self.stack_trace = "".join(traceback.format_stack()[:-1])
        super().__init__(f"{e}\n{self.stack_trace}")


class _Work(Protocol):
    """A collective's handle as the Manager returns it (``torchheal.work._ManagedWork``)."""

    _waited: bool

    def wait(self) -> Any: ...


class _Log(Protocol):
    def warning(self, msg: str, exc_info: BaseException | None = None) -> None: ...

    def debug(self, msg: str) -> None: ...


class _Future(Protocol):
    def wait(self) -> Any: ...


class StepLedger:
    """The error of the current step and what must land before it is voted on.

    ``begin`` opens a step; ``report`` records a failure (the latest one is kept, as the
    reference does); ``track_work``/``track_future`` remember what was issued; ``settle``
    waits for it. Reports come from the training thread, the quorum thread and future
    callbacks; a lock keeps the lists consistent between them.
    """

    def __init__(
        self,
        log: _Log | None = None,
        counted: Callable[[], None] = lambda: None,
    ) -> None:
        self._log: _Log = log or logging.getLogger(__name__)
        self._counted = counted  # the error counter
        self._lock = threading.Lock()
        self._error: ExceptionWithTraceback | None = None
        #: Whether a failure of this step came from outside the step's collectives and
        #: quorum (the training loop's own ``report_error``): a new quorum would not cure it.
        self.foreign_error = False
        #: Collectives of this step skipped because it had failed: the process group's peers
        #: ran them, so any later collective of the step would pair with the wrong one.
        self.skipped = 0
        self._works: list[_Work] = []
        self._futures: list[_Future] = []

    @property
    def error(self) -> ExceptionWithTraceback | None:
        """The error reported in this step, or None."""
        return self._error

    @error.setter
    def error(self, value: ExceptionWithTraceback | None) -> None:
        self._error = value

    def begin(self) -> None:
        """Opens a new step: no error, nothing outstanding."""
        with self._lock:
            self._error = None
            self.foreign_error = False
            self.skipped = 0
            self._works = []
            self._futures = []

    def report(self, e: Exception, foreign: bool = False) -> bool:
        """Records that the step failed (the latest error is the one kept, as the reference's).

        Args:
            e: what failed.
            foreign: it came from outside the step's collectives and quorum.

        Returns:
            whether this is the step's first error: one failure usually fails every bucket's
            collective, and only the first is worth a log line.
        """
        wrapped = ExceptionWithTraceback(e)
        with self._lock:
            first = self._error is None
            self._error = wrapped
            if foreign:
                self.foreign_error = True
        return first

    def fail(
        self,
        e: Exception,
        foreign: bool = False,
        how: str = "step failed",
        trace: bool = False,
        cause: bool = True,
    ) -> None:
        """Fails the step (:meth:`report`), counted and logged.

        One failure fails every collective of the step after it (a lost peer: each bucket's
        allreduce), so only the step's first error is logged where users look; the rest go to
        debug.

        Args:
            e: what failed.
            foreign: reported by the training loop, not by the step's collectives or quorum (a
                new quorum would not cure it: such a step is never salvaged).
            how: what failed, for the log.
            trace: log the traceback.
            cause: False when ``how`` says it all (the error only repeats it in the backend's
                words).
        """
        first = self.report(e, foreign=foreign)
        self._counted()
        if first:
            line = f"{how}: {type(e).__name__}: {e}" if cause else how
            self._log.warning(line, exc_info=e if trace else None)
        else:
            self._log.debug(f"{how} (the step had failed already): {type(e).__name__}: {e}")

    def track_work(self, work: _Work) -> None:
        """Remembers a collective issued in this step.

        Args:
            work: its handle; ``settle`` waits for it unless someone already did.
        """
        with self._lock:
            self._works.append(work)

    def track_future(self, fut: _Future) -> None:
        """Remembers a future whose failure is swallowed into :meth:`report`.

        Args:
            fut: the wrapped future; ``settle`` waits for it.
        """
        with self._lock:
            self._futures.append(fut)

    def settle(self) -> None:
        """Waits for this step's unwaited collectives, then its wrapped futures.

        A work's ``wait`` and a wrapped future report their own failures here, so once the
        step has an error the rest is not waited for: the vote is "no" already (what is left
        stays for :meth:`drain`).
        """
        while self._error is None:
            with self._lock:
                if self._works:
                    work: _Work | None = self._works.pop(0)
                    fut: _Future | None = None
                elif self._futures:
                    work, fut = None, self._futures.pop(0)
                else:
                    return
            if work is not None and not work._waited:
                work.wait()
            elif fut is not None:
                fut.wait()

    def drain(self) -> None:
        """Waits for every collective and wrapped future of the step that nobody waited for.

        For a step that is redone: nothing of the failed attempt may still write into its
        tensors. (A work handed on as a future, as DDP's comm hook does, was waited by its
        holder before the vote.) Their failures are reported as usual; the caller opens the
        step again.
        """
        with self._lock:
            works, self._works = self._works, []
            futures, self._futures = self._futures, []
        for work in works:
            if not work._waited:
                work.wait()
        for fut in futures:
            fut.wait()
