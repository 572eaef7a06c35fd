"""gRPC plumbing shared by the coordination servers and clients.

What lives here: address parsing, channel creation with the reference's connection settings
(§3.3), the mapping from gRPC status to Python exceptions, method-handler construction that
turns bad requests into ``INVALID_ARGUMENT``, and :class:`AioServerThread`, which runs a
``grpc.aio`` server on its own event-loop thread so that servers never block the thread that
created them (in a training process: the training thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from torchheal._wire.methods import Method

__all__ = [
    "AioServerThread",
    "RPCError",
    "StatusError",
    "UnaryCaller",
    "aio_connect",
    "connect",
    "format_target",
    "parse_address",
    "parse_grpc_timeout",
    "rpc_error_to_exception",
    "status_name",
    "to_seconds",
    "unary_handler",
]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

# Connection settings of the reference (§3.3): HTTP/2 keep-alive every 60 s with a 20 s timeout,
# also while idle; reconnect backoff starting at 100 ms and capped at 10 s. gRPC's own reconnect
# loop (multiplier 1.6, jitter 20%) then plays the part of the reference's connect retries.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 10_000),
]

# Servers accept the clients' idle keep-alive pings (the default would answer them with
# GOAWAY "too_many_pings") and refuse to share a port: gRPC sets SO_REUSEPORT by default on
# Linux, which would let a second server "bind" a port that is already taken.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


# --------------------------------------------------------------------------------------------
# Addresses and times


def parse_address(addr: str) -> tuple[str, int]:
    """Split an address into host and port.

    Accepts ``http://host:port``, ``host:port`` and ``[v6addr]:port`` (with or without the
    ``http://`` scheme; a trailing ``/`` is ignored).

    Args:
        addr: the address.

    Returns:
        ``(host, port)``; an IPv6 host is returned without brackets.

    Raises:
        ValueError: the address has another scheme, no host, no port, a port outside
            0..65535, or an IPv6 host without brackets.
    """
    if not isinstance(addr, str):
        raise ValueError(f"address must be a string, got {type(addr).__name__}")
    rest = addr.strip()
    if "://" in rest:
        scheme, _, rest = rest.partition("://")
        if scheme != "http":
            raise ValueError(f"unsupported scheme {scheme!r} in address {addr!r}; use http://")
    rest = rest.rstrip("/")
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0 or rest[close + 1 : close + 2] != ":":
            raise ValueError(f"invalid address {addr!r}: expected [ipv6]:port")
        host, port_text = rest[1:close], rest[close + 2 :]
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            raise ValueError(f"invalid address {addr!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"invalid address {addr!r}: put an IPv6 host in brackets, [::1]:port")
    if not host:
        raise ValueError(f"invalid address {addr!r}: missing host")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"invalid address {addr!r}: port must be an integer in 0..65535")
    return host, int(port_text)


def format_target(host: str, port: int) -> str:
    """Join host and port into a gRPC target, bracketing IPv6 hosts.

    Args:
        host: host name or IP address (IPv6 without brackets).
        port: TCP port.
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def to_seconds(timeout: timedelta | float | int) -> float:
    """Convert a timeout to float seconds.

    Args:
        timeout: a ``timedelta`` (the public API's type) or a number of seconds.

    Raises:
        ValueError: the timeout is negative.
        TypeError: the timeout is neither a timedelta nor a number.
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a timedelta, got {type(timeout).__name__}")
    if seconds < 0:
        raise ValueError(f"timeout must not be negative, got {timeout!r}")
    return seconds


_GRPC_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_GRPC_TIMEOUT_RE = re.compile(r"([0-9]{1,8})([HMSmun])")


def parse_grpc_timeout(value: str) -> float:
    """Parse a ``grpc-timeout`` header value (at most 8 digits and a unit) into seconds.

    gRPC itself parses the header before our handlers run; this exists for tools and tests that
    deal with raw headers, and documents the format.

    Args:
        value: e.g. ``"100m"`` (100 ms), ``"5S"``, ``"1H"``.

    Raises:
        ValueError: empty value, more than 8 digits, or an unknown unit.
    """
    match = _GRPC_TIMEOUT_RE.fullmatch(value)
    if match is None:
        raise ValueError(
            f"invalid timeout {value!r}: expected up to 8 digits and a unit H/M/S/m/u/n"
        )
    return int(match.group(1)) * _GRPC_TIMEOUT_UNITS[match.group(2)]


# --------------------------------------------------------------------------------------------
# Errors


class RPCError(RuntimeError):
    """A remote call failed with a gRPC status other than a timeout.

    Args:
        message: human-readable text, naming the call.
        code: the gRPC status code.
        details: the server's status message.
    """

    def __init__(self, message: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class StatusError(Exception):
    """Raised inside a server handler to answer with a given gRPC status.

    Args:
        code: the status to answer with.
        details: the message the client sees.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def status_name(code: grpc.StatusCode) -> str:
    """The status name as the reference prints it, e.g. ``InvalidArgument``.

    Args:
        code: the gRPC status code.
    """
    return "".join(part.capitalize() for part in code.name.split("_"))


def rpc_error_to_exception(error: grpc.RpcError, what: str) -> Exception:
    """Map a failed call to the exception the public API raises (reference §2.4).

    ``DEADLINE_EXCEEDED`` and ``CANCELLED`` become :class:`TimeoutError`; any other status
    becomes :class:`RPCError` (a ``RuntimeError``) carrying the server's status and message.
    Messages follow the reference's ``status: <Name>, message: "<details>"`` form; a timeout
    reads ``status: Cancelled, message: "Timeout expired"`` as the reference's servers answer,
    followed by what gRPC reported, because users match on the reference's text.

    Args:
        error: the exception gRPC raised (a ``grpc.Call`` as well).
        what: the call, for the message, e.g. ``"LighthouseService/Quorum to host:1"``.
    """
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else str(error)) or ""
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return TimeoutError(
            f'{what} failed: status: Cancelled, message: "Timeout expired" '
            f"(gRPC {code.name}: {details})"
        )
    return RPCError(
        f'{what} failed: status: {status_name(code)}, message: "{details}"', code, details
    )


# --------------------------------------------------------------------------------------------
# Clients


def connect(addr: str, connect_timeout: timedelta | float) -> grpc.Channel:
    """Open a blocking channel and wait until it is connected.

    Args:
        addr: server address (see :func:`parse_address`).
        connect_timeout: how long to keep trying before giving up.

    Returns:
        A ready channel; safe to share between threads.

    Raises:
        ValueError: the address is malformed.
        RuntimeError: the server could not be reached within ``connect_timeout``.
    """
    target = format_target(*parse_address(addr))
    timeout_s = to_seconds(connect_timeout)
    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise RuntimeError(
            f"failed to connect to {addr} within timeout of {timeout_s:g}s; "
            "verify the address and that the server is running"
        ) from None
    return channel


async def aio_connect(addr: str, connect_timeout: timedelta | float) -> grpc.aio.Channel:
    """Open an asyncio channel and wait until it is connected.

    Args:
        addr: server address (see :func:`parse_address`).
        connect_timeout: how long to keep trying before giving up.

    Raises:
        ValueError: the address is malformed.
        RuntimeError: the server could not be reached within ``connect_timeout``.
    """
    target = format_target(*parse_address(addr))
    timeout_s = to_seconds(connect_timeout)
    channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except asyncio.TimeoutError:
        await channel.close()
        raise RuntimeError(
            f"failed to connect to {addr} within timeout of {timeout_s:g}s; "
            "verify the address and that the server is running"
        ) from None
    return channel


class UnaryCaller:
    """A blocking unary method bound to a channel, with deadlines and error mapping.

    Args:
        channel: a blocking channel (thread-safe; so is this object).
        method: the method to call.
        target: the server address, for error messages.
    """

    def __init__(self, channel: grpc.Channel, method: Method, target: str) -> None:
        self._method = method
        self._what = f"{method.service.removeprefix('torchft.')}/{method.name} to {target}"
        self._call = channel.unary_unary(
            method.path,
            request_serializer=_serialize,
            response_deserializer=method.response.FromString,
        )

    def __call__(self, request: Message, timeout: timedelta | float) -> Any:
        """Send ``request`` and wait at most ``timeout`` for the response.

        Args:
            request: the request message.
            timeout: the call's deadline, sent to the server as ``grpc-timeout``.

        Raises:
            TimeoutError: the deadline passed or the call was cancelled.
            RPCError: any other failure, with the server's status and message.
        """
        try:
            return self._call(request, timeout=to_seconds(timeout))
        except grpc.RpcError as e:
            raise rpc_error_to_exception(e, self._what) from None
        except ValueError as e:
            # grpc raises ValueError for a call on a closed channel.
            raise RuntimeError(f"{self._what} failed: {e}") from e


def _serialize(message: Message | bytes) -> bytes:
    # A handler may return bytes it serialized once for many callers (a quorum broadcast).
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


# --------------------------------------------------------------------------------------------
# Servers

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message | bytes]]


def unary_handler(method: Method, handler: Handler) -> grpc.RpcMethodHandler:
    """Build a gRPC method handler that parses requests itself.

    Requests arrive as raw bytes so that bytes which do not parse get ``INVALID_ARGUMENT``
    naming the message type. A :class:`StatusError` raised by ``handler`` becomes that status;
    any other exception is logged and becomes ``INTERNAL``, and the server keeps serving.

    Args:
        method: the method served.
        handler: ``async (request, context) -> response`` (a message, or its serialized bytes).
    """
    request_name = method.request.DESCRIPTOR.name

    async def serve(raw: bytes, context: grpc.aio.ServicerContext) -> Message | bytes:
        try:
            request = method.request.FromString(raw)
        except DecodeError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse {request_name}: {e}"
            )
        try:
            return await handler(request, context)
        except StatusError as e:
            await context.abort(e.code, e.details)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            logger.exception("%s failed", method.path)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.path} failed: {e}")
        raise AssertionError("unreachable: context.abort raises")

    return grpc.unary_unary_rpc_method_handler(
        serve, request_deserializer=None, response_serializer=_serialize
    )


class AioServerThread:
    """A ``grpc.aio`` server running on its own event loop in a daemon thread.

    The constructor returns once the server is bound and serving. Everything the server does
    (handlers, background tasks started with :meth:`spawn`) runs on that loop; other threads
    talk to it through :meth:`submit`. :meth:`shutdown` is idempotent and thread-safe.

    Args:
        name: thread name, also used in log messages.
        bind: address to listen on, e.g. ``"[::]:29510"`` or ``"127.0.0.1:0"``.
        handlers: service name -> {method name -> handler from :func:`unary_handler`}.
        startup: optional coroutine function run on the loop before the server starts
            serving (for example, to connect to another server); its exception aborts start-up.
        cleanup: optional coroutine function run on the loop at shutdown, after the server
            stopped (for example, to close channels opened by ``startup``).

    Raises:
        ValueError: ``bind`` is malformed.
        RuntimeError: the address could not be bound, or ``startup`` failed.
    """

    def __init__(
        self,
        name: str,
        bind: str,
        handlers: dict[str, dict[str, grpc.RpcMethodHandler]],
        startup: Callable[[], Coroutine[Any, Any, None]] | None = None,
        cleanup: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self._name = name
        self._target = format_target(*parse_address(bind))
        self._handlers = handlers
        self._startup = startup
        self._cleanup = cleanup
        self._lock = threading.Lock()
        self._stopped = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: grpc.aio.Server | None = None
        self._port = 0
        self._loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        try:
            ready.result()
        except BaseException:
            self._thread.join()
            raise

    @property
    def port(self) -> int:
        """The TCP port the server is bound to."""
        return self._port

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop."""
        return self._loop

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:
            if self._cleanup is not None:
                try:
                    self._loop.run_until_complete(self._cleanup())
                except Exception:
                    logger.exception("%s: cleanup after failed start-up failed", self._name)
            ready.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            self._close_loop()
            return
        ready.set_result(None)
        try:
            self._loop.run_forever()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        try:
            pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            self._loop.close()

    async def _start(self) -> None:
        if self._startup is not None:
            await self._startup()
        server = grpc.aio.server(options=SERVER_OPTIONS)
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(service, methods)
                for service, methods in self._handlers.items()
            ]
        )
        try:
            port = server.add_insecure_port(self._target)
        except RuntimeError as e:
            raise RuntimeError(f"{self._name}: failed to bind {self._target}: {e}") from e
        if port == 0:
            raise RuntimeError(f"{self._name}: failed to bind {self._target}")
        await server.start()
        self._server = server
        self._port = port

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a background task on the server loop; it is cancelled at shutdown.

        Must be called from the loop thread (from ``startup``, a handler or another task).

        Args:
            coro: the coroutine to run.
        """
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task failed", self._name, exc_info=task.exception())

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the server loop from any thread.

        Args:
            coro: the coroutine to run.

        Returns:
            A future with its result.

        Raises:
            RuntimeError: the server was shut down.
        """
        with self._lock:
            if self._stopped:
                coro.close()
                raise RuntimeError(f"{self._name} is shut down")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def shutdown(self, grace: float | None = None, timeout: float = 10.0) -> None:
        """Stop serving, cancel background tasks, and end the loop thread.

        Calls still in progress are cancelled (after ``grace`` seconds if given).
        Safe to call more than once and from any thread, including the loop thread.

        Args:
            grace: seconds to let in-flight calls finish; None cancels them at once.
            timeout: longest wait for the loop thread to end.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if threading.current_thread() is self._thread:
            # Called from a handler or task: stopping must not wait on ourselves.
            self._loop.create_task(self._stop(grace))
            return
        future = asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop)
        try:
            future.result(timeout=timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("%s: shutdown did not finish within %ss", self._name, timeout)
        self._thread.join(timeout=timeout)

    async def _stop(self, grace: float | None) -> None:
        for task in list(self._tasks):
            task.cancel()
        try:
            if self._server is not None:
                await self._server.stop(grace)
            if self._cleanup is not None:
                await self._cleanup()
        finally:
            self._loop.call_soon(self._loop.stop)
