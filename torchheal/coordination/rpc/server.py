"""Server side of gRPC: method handlers and a ``grpc.aio`` server on its own event-loop thread.

:class:`AioServerThread` runs the server on a daemon thread so that it never blocks the thread
that created it (in a training process: the training thread). With a job token every call must
carry it (``auth.TokenGuard``); with TLS the port speaks TLS only (``docs/security.md``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from torchheal._base.security import SecurityEnv
from torchheal._wire.methods import Method
from torchheal.coordination.rpc.addresses import format_target, parse_address
from torchheal.coordination.rpc.auth import TokenGuard
from torchheal.coordination.rpc.channels import serialize
from torchheal.coordination.rpc.errors import StatusError
from torchheal.coordination.rpc.tls import server_credentials

__all__ = [
    "SERVER_OPTIONS",
    "AioServerThread",
    "Handler",
    "StreamHandler",
    "unary_handler",
    "unary_stream_handler",
]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

# Accept the clients' idle keep-alive pings (the default answers GOAWAY "too_many_pings"); refuse
# SO_REUSEPORT, which would let a second server "bind" a taken port. Slow handshakes and idle
# connections are closed, so nobody holds connections open by saying nothing.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.server_handshake_timeout_ms", 10_000),
    ("grpc.max_connection_idle_ms", 60_000),
]


Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message | bytes]]


def unary_handler(method: Method, handler: Handler) -> grpc.RpcMethodHandler:
    """Build a gRPC method handler that parses requests itself.

    Requests arrive as raw bytes so that bytes which do not parse get ``INVALID_ARGUMENT``
    naming the message type. A :class:`StatusError` raised by ``handler`` (``async (request,
    context) -> message or bytes``) becomes that status; any other exception ``INTERNAL``.
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
        serve, request_deserializer=None, response_serializer=serialize
    )


StreamHandler = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Message | bytes]]


def unary_stream_handler(method: Method, handler: StreamHandler) -> grpc.RpcMethodHandler:
    """Build a handler for a method with one request and a stream of responses.

    As :func:`unary_handler`, with ``handler`` an async generator of responses.
    """
    request_name = method.request.DESCRIPTOR.name

    async def serve(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = method.request.FromString(raw)
        except DecodeError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse {request_name}: {e}"
            )
        try:
            async for response in handler(request, context):
                yield response
        except StatusError as e:
            await context.abort(e.code, e.details)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            logger.exception("%s failed", method.path)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method.path} failed: {e}")

    return grpc.unary_stream_rpc_method_handler(
        serve, request_deserializer=None, response_serializer=serialize
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
        startup: coroutine function run on the loop before serving; its exception aborts.
        cleanup: coroutine function run on the loop at shutdown, after the server stopped.
        options: gRPC server options (default :data:`SERVER_OPTIONS`).
        security: job token and TLS settings (built by the owner, never read here).

    Raises:
        ValueError: ``bind`` or the security settings are malformed.
        RuntimeError: the address could not be bound, ``startup`` failed, or TLS is on without
            a certificate.
    """

    def __init__(
        self,
        name: str,
        bind: str,
        handlers: dict[str, dict[str, grpc.RpcMethodHandler]],
        startup: Callable[[], Coroutine[Any, Any, None]] | None = None,
        cleanup: Callable[[], Coroutine[Any, Any, None]] | None = None,
        options: list[tuple[str, Any]] | None = None,
        *,
        security: SecurityEnv,
    ) -> None:
        self._name = name
        self._security = security
        self._options = SERVER_OPTIONS if options is None else options
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
        security = self._security
        credentials = server_credentials(security, self._name) if security.tls else None
        server = grpc.aio.server(
            options=self._options,
            interceptors=None if security.token is None else [TokenGuard(security.token)],
        )
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(service, methods)
                for service, methods in self._handlers.items()
            ]
        )
        try:
            if credentials is not None:
                port = server.add_secure_port(self._target, credentials)
            else:
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
        """
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task failed", self._name, exc_info=task.exception())

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the server loop from any thread (``RuntimeError`` once shut down)."""
        with self._lock:
            if self._stopped:
                coro.close()
                raise RuntimeError(f"{self._name} is shut down")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def shutdown(self, grace: float | None = None, timeout: float = 10.0) -> None:
        """Stop serving, cancel background tasks, and end the loop thread.

        Calls in progress are cancelled after ``grace`` seconds (None: at once); waits up to
        ``timeout`` for the thread. Safe to call more than once, from any thread.
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
