"""Fault-tolerant work objects returned by ``Manager.allreduce``.

A :class:`_ManagedWork` holds a lazy chain of callbacks, built only when someone waits, so they
run in the order attached on the waiting thread. Failures never escape into the training loop:
they are reported and ``wait`` returns ``False``. With a :class:`StepSink` the first continuation
runs as one callback on the collective's future (each callback takes the GIL once per bucket).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

# _DummyWork is re-exported so the reference's import path resolves.
from torchheal.futures import Expiry
from torchheal.process_group.work import _DummyWork, _ErrorRecordingWork

__all__ = ["StepSink", "_DummyWork", "_ManagedFuture", "_ManagedWork"]

logger: logging.Logger = logging.getLogger(__name__)


class _ErrorSink(Protocol):
    """The part of the Manager a managed work needs (duck-typed: no import of manager.py)."""

    def wrap_future(
        self, fut: torch.futures.Future[Any], default: Any, timeout: timedelta | None = None
    ) -> torch.futures.Future[Any]: ...

    def report_error(self, e: Exception) -> None: ...


class StepSink(Protocol):
    """The Manager's extensions beside the reference's sink: it times the first continuation
    itself and fails the step."""

    def wrap_future_then(
        self,
        fut: torch.futures.Future[Any],
        then: Callable[[torch.futures.Future[Any]], Any],
        default: Any,
        timeout: timedelta | None = None,
        foreign: bool = False,
        expiry: Expiry | None = None,
    ) -> torch.futures.Future[Any]:
        """``wrap_future(fut.then(then), default)`` in one callback on ``fut``.

        ``foreign``: a failure is the loop's own, not the step's; ``expiry`` ends the wait early.
        """
        ...

    def fail_step(
        self,
        e: Exception,
        foreign: bool = False,
        how: str = "step failed",
        trace: bool = False,
        cause: bool = True,
    ) -> None:
        """Fails the step: it will not commit (``cause`` False: only counted)."""
        ...


def _completed_future(value: Any) -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _current_stream() -> torch.cuda.Stream | None:
    # Streams only matter on CUDA; the CPU path stays plain.
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


class _ManagedFuture(torch.futures.Future):
    """One node of a managed work's lazy callback chain: only ``then`` and ``wait`` work (a
    node has a value only once a wait materialised the chain)."""

    def __init__(
        self, work: _ManagedWork, callback: Callable[[torch.futures.Future[Any]], Any] | None
    ) -> None:
        super().__init__()
        self._work = work
        self._callback = callback
        self._next: _ManagedFuture | None = None
        # The real future of this node, set when the chain is materialised.
        self._future: torch.futures.Future[Any] | None = None

    def then(self, callback: Callable[[torch.futures.Future[Any]], Any]) -> _ManagedFuture:  # type: ignore[override]
        """Records ``callback`` to run after this node; returns the new tail node."""
        return self._work._append(self, callback)

    def wait(self) -> Any:
        """Materialises the chain (if needed) and waits for this node's value."""
        self._work._materialize()
        assert self._future is not None
        return self._future.wait()

    def value(self) -> Any:
        raise NotImplementedError("_ManagedFuture.value: call wait() instead")

    def done(self) -> bool:
        raise NotImplementedError("_ManagedFuture.done is not supported")

    def add_done_callback(self, callback: Callable[..., None]) -> None:
        raise NotImplementedError("_ManagedFuture.add_done_callback: use then()")

    def set_result(self, result: Any) -> None:
        raise NotImplementedError("_ManagedFuture.set_result is not supported")

    def set_exception(self, result: BaseException) -> None:
        raise NotImplementedError("_ManagedFuture.set_exception is not supported")


def _extended(manager: Any, step: StepSink | None) -> StepSink | None:
    """``step``, unless ``wrap_future`` was replaced on the manager instance (the reference's
    tests do): the replacement must see the first continuation, which fusing skips."""
    if step is None or "wrap_future" in getattr(manager, "__dict__", {}):
        return None
    return step


class _ManagedWork(dist.Work):
    """A process-group work whose errors are reported to the manager instead of raised.

    ``default_result`` is what the chain resolves to when the collective fails (garbage the step
    discards); ``expiry`` ends it early; ``step`` (normally the manager) fuses the first
    continuation into one timed callback, None keeps the reference's plain sink.
    """

    def __init__(
        self,
        manager: _ErrorSink,
        work: dist.Work,
        default_result: Any,
        expiry: Expiry | None = None,
        step: StepSink | None = None,
    ) -> None:
        super().__init__()
        self._manager = manager
        self._work = work
        self._default_result = default_result
        self._step = _extended(manager, step)
        self._wrap_then = self._step.wrap_future_then if self._step is not None else None
        # Only a manager that times the first continuation itself can end it early.
        self._expiry = expiry if self._wrap_then is not None else None
        # The first continuation saw the collective fail, time out or expire.
        self._failed = False
        self._stream = _current_stream()
        self._lock = threading.Lock()
        self._head = _ManagedFuture(self, None)
        self._tail = self._head
        self._materialized = False
        self._waited = False

    # -- chain construction -------------------------------------------------------------

    def _append(
        self, node: _ManagedFuture, callback: Callable[[torch.futures.Future[Any]], Any]
    ) -> _ManagedFuture:
        with self._lock:
            if node is not self._tail:
                raise ValueError("then() may only be called on the tail of a managed work chain")
            new = _ManagedFuture(self, callback)
            node._next = new
            self._tail = new
            if self._materialized:
                # Already waited once: extend the real chain right away.
                assert node._future is not None
                new._future = self._derive(node._future, new, first=node is self._head)
            return new

    def _run_node(self, node: _ManagedFuture) -> Callable[[torch.futures.Future[Any]], Any]:
        # A factory so each continuation is bound to its own node (see module docstring).
        stream = self._stream
        callback = node._callback
        assert callback is not None

        def step(prev: torch.futures.Future[Any]) -> Any:
            value = prev.value()  # re-raises the previous node's error
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                return callback(_completed_future(value))

        return step

    def _derive(
        self, prev: torch.futures.Future[Any], node: _ManagedFuture, first: bool
    ) -> torch.futures.Future[Any]:
        fut = prev.then(self._run_node(node))
        if first:
            # The first continuation (normalisation) swallows errors and times out.
            fut = self._manager.wrap_future(fut, self._default_result)
        return fut

    def _fused_first(self, node: _ManagedFuture) -> torch.futures.Future[Any] | None:
        # The first continuation and everything around it in one callback (module docstring);
        # None where the manager cannot (see _extended).
        wrap_then = self._wrap_then
        if wrap_then is None:
            return None
        work = self._work
        if isinstance(work, _ErrorRecordingWork):
            raw, report = work.take_future()
        else:
            raw, report = work.get_future(), None
        raw = self._torch_future(raw)
        self._head._future = raw
        stream = self._stream
        callback = node._callback
        assert callback is not None

        def first(f: torch.futures.Future[Any]) -> Any:
            try:
                f.value()  # re-raises the collective's error, the timeout or the expiry
            except Exception as e:
                self._failed = True
                if f is raw and report is not None:  # the collective failed, not timed out
                    report(e)
                raise
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                return callback(f)

        return wrap_then(raw, first, self._default_result, expiry=self._expiry)

    def _torch_future(self, fut: Any) -> torch.futures.Future[Any]:
        """``fut``, or for a work whose ``get_future`` gives no torch future (a stand-in, as
        the reference's tests mock process groups) one its ``wait()`` completes: there is
        nothing else to chain on. Waited here, on the caller's thread."""
        # c10d's works hand out the C++ base class, not the Python subclass: test the base.
        if isinstance(fut, torch._C.Future):
            return fut  # type: ignore[return-value]
        work = self._work
        inner = work._work if isinstance(work, _ErrorRecordingWork) else work
        waited: torch.futures.Future[Any] = torch.futures.Future()
        try:
            inner.wait()
        except Exception as e:
            waited.set_exception(e)
        else:
            waited.set_result(self._default_result)
        return waited

    def _materialize(self) -> None:
        with self._lock:
            if self._materialized:
                return
            node, first = self._head._next, True
            fut = self._fused_first(node) if node is not None else None
            if fut is not None:
                assert node is not None
                node._future = fut
                node, first = node._next, False
            else:
                fut = self._torch_future(self._work.get_future())
                self._head._future = fut
            while node is not None:
                fut = self._derive(fut, node, first)
                node._future = fut
                node, first = node._next, False
            self._materialized = True

    # -- Work API ----------------------------------------------------------------------

    def get_future(self) -> _ManagedFuture:  # type: ignore[override]
        """Returns the tail of the lazy callback chain (attach callbacks with ``then``)."""
        return self._tail

    def as_future(self) -> torch.futures.Future[Any]:
        """Builds the callback chain without waiting and returns its real tail future.

        For callers that hand a future on (DDP's comm hook). It never fails: an error resolves to
        the default result. Without a :class:`StepSink` to time the chain, this waits first.
        """
        if self._wrap_then is None:
            if not self.wait():
                return _completed_future(self._default_result)
        self._waited = True
        self._materialize()
        assert self._tail._future is not None
        return self._tail._future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the collective and runs the callback chain on this thread.

        Returns False when anything failed (the error is reported to the manager).
        """
        self._waited = True
        try:
            if self._stream is not None and torch.cuda.current_stream() != self._stream:
                raise RuntimeError("_ManagedWork.wait must run on the stream that created it")
            if self._expiry is not None and self._stream is None and timeout is None:
                # On CPU the expiry can end the chain sooner than the operation's own wait,
                # which may never be woken (Gloo, after a freeze).
                self._materialize()
                assert self._tail._future is not None
                self._tail._future.wait()
                return not self._failed
            if timeout is not None:
                self._work.wait(timeout)
            else:
                self._work.wait()
            self._materialize()
            assert self._tail._future is not None
            self._tail._future.wait()
            return True
        except Exception as e:
            if self._step is not None:
                self._step.fail_step(e, how="collective failed, the step will not commit")
            else:
                logger.warning("collective failed; the step will not commit: %s", e)
                self._manager.report_error(e)
            return False

    def block_current_stream(self) -> None:
        """Makes the current stream wait for the collective without blocking the CPU."""
        self._work.block_current_stream()
        self._materialize()

    def synchronize(self) -> None:
        """Like ``block_current_stream`` on CUDA; on CPU only materialises the chain."""
        if torch.cuda.is_available():
            self.block_current_stream()
        else:
            self._materialize()

    def is_completed(self) -> bool:
        """True once the chain is materialised and its tail has a value."""
        with self._lock:
            fut = self._tail._future if self._materialized else None
        return fut is not None and fut.done()
