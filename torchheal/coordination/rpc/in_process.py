"""Calling a server's handler from the server's own process, with gRPC's deadline and errors.

Group rank 0 runs in the process of its replica group's ManagerServer; :class:`InProcessCaller`
lets it run the very coroutine a gRPC handler would run, on the server's loop, minus the round
trip to itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, Generic, TypeVar

import grpc

from torchheal._base.timeouts import to_seconds
from torchheal._wire.methods import Method
from torchheal.coordination.rpc.errors import StatusError, status_error

__all__ = ["IN_PROCESS_GRACE_S", "InProcessCaller"]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

# An in-process call's deadline is enforced on the server's loop; the calling thread waits this
# much longer only to give up on a loop that does not answer at all.
IN_PROCESS_GRACE_S = 5.0


class _DeadlineExceeded(Exception):
    """An in-process call's deadline passed (over gRPC: ``DEADLINE_EXCEEDED``)."""


async def _with_deadline(call: Coroutine[Any, Any, T], timeout_s: float) -> T:
    # Cancel ``call`` at the deadline, as gRPC cancels a handler, and let its clean-up run first.
    # A timer rather than asyncio.wait_for spares a task and a loop turn per call.
    task = asyncio.current_task()
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        return await call
    except asyncio.CancelledError:
        if expired:
            raise _DeadlineExceeded() from None
        raise  # cancelled from outside: the server is shutting down
    finally:
        timer.cancel()


class InProcessCaller(Generic[T]):
    """A server handler called from the server's own process, with gRPC's deadline and errors.

    The handler coroutine runs on the server's event loop (all server state lives there) and is
    cancelled at its deadline, as gRPC cancels a handler. Errors are those ``UnaryCaller`` raises
    for the same outcome over gRPC: ``TimeoutError`` at the deadline; :class:`RPCError` with the
    handler's :class:`StatusError` status, ``UNAVAILABLE`` once the server is shut down, or
    ``INTERNAL`` for an unexpected exception.

    Args:
        submit: runs a coroutine on the server's loop from any thread (``AioServerThread.submit``).
        method: the method the handler serves, for messages.
        target: the server's address, for messages.
    """

    def __init__(
        self,
        submit: Callable[[Coroutine[Any, Any, T]], concurrent.futures.Future[T]],
        method: Method,
        target: str,
    ) -> None:
        self._submit = submit
        self._method = method
        self._what = f"{method.service.removeprefix('torchft.')}/{method.name} to {target}"

    def start(
        self, call: Coroutine[Any, Any, T], timeout: timedelta | float
    ) -> concurrent.futures.Future[T]:
        """Start the handler coroutine ``call`` on the server's loop without waiting for it.

        The returned future fails with the error a gRPC client would get. A waiter guards
        against a loop that never answers itself: it waits at most the deadline plus
        :data:`IN_PROCESS_GRACE_S`. Callbacks added to it run on the loop thread: keep them quick.
        """
        timeout_s = to_seconds(timeout)
        out: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            future = self._start(call, timeout_s)
        except BaseException as e:
            out.set_exception(e)
            return out

        def settle(done: concurrent.futures.Future[T]) -> None:
            try:
                result = done.result()
            except BaseException as e:
                out.set_exception(self._error(e, timeout_s))
                return
            out.set_result(result)

        future.add_done_callback(settle)
        return out

    def _start(
        self, call: Coroutine[Any, Any, T], timeout_s: float
    ) -> concurrent.futures.Future[T]:
        try:
            return self._submit(_with_deadline(call, timeout_s))
        except RuntimeError as e:
            call.close()  # never started: close it rather than leave it unawaited
            raise status_error(self._what, grpc.StatusCode.UNAVAILABLE, str(e)) from None

    def _error(self, e: BaseException, timeout_s: float) -> BaseException:
        # The error a gRPC client gets for what the handler's coroutine ended with.
        what = self._what
        if isinstance(e, _DeadlineExceeded):
            return TimeoutError(
                f'{what} failed: status: Cancelled, message: "Timeout expired" '
                f"(in-process deadline of {timeout_s:g}s exceeded)"
            )
        if isinstance(e, StatusError):
            return status_error(what, e.code, e.details)
        if isinstance(e, concurrent.futures.CancelledError):
            # The loop cancelled the call: the server is shutting down.
            return status_error(what, grpc.StatusCode.UNAVAILABLE, "manager server shut down")
        if not isinstance(e, Exception):
            return e  # KeyboardInterrupt and the like go through as they are
        # What unary_handler does on the gRPC path: log it and answer INTERNAL.
        logger.error("%s failed", self._method.path, exc_info=e)
        details = f"{self._method.path} failed: {e}"
        return status_error(what, grpc.StatusCode.INTERNAL, details)
