"""Shared helpers for the coordination I/O tests: loopback addresses and raw calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc


def loopback(server: Any) -> str:
    """``127.0.0.1:{port}`` of a server (its ``address()`` names the host, not loopback)."""
    return f"127.0.0.1:{server.port()}"


def raw_call(
    addr: str, path: str, payload: bytes, timeout: float | None = 5.0
) -> tuple[grpc.StatusCode, bytes | str]:
    """Send raw bytes on a method path; return (OK, response bytes) or (code, details)."""
    with grpc.insecure_channel(addr) as channel:
        call = channel.unary_unary(path)  # no serializers: bytes in, bytes out
        try:
            return grpc.StatusCode.OK, call(payload, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details()


class Background:
    """Run a function on a thread and collect its result or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:
            self.error = e

    def join(self, timeout: float = 20.0) -> Any:
        """Wait for the function; re-raise its exception; fail if it is still running."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"call still running after {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` until true, for states only observable by polling (e.g. ``status()``)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: a wait on it is an interruptible pause
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        pause.wait(0.01)
