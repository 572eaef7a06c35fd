"""The job token on every call: checked by servers, sent by clients.

An endpoint with a job token (``_base/security.py``) accepts a request only when it carries
``authorization: Bearer <token>``: as gRPC metadata (:class:`TokenGuard`, the client
interceptors) or as the HTTP header of the checkpoint transport and dashboard
(:func:`bearer_matches`); the direct lane carries it in its ``Hello``. A refused gRPC call ends
``UNAUTHENTICATED`` before its handler runs. With no token none of this is installed: the wire
is the reference's, byte for byte.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import grpc
import grpc.aio

__all__ = [
    "AUTH_HEADER",
    "RefusalLog",
    "TokenGuard",
    "aio_client_interceptors",
    "bearer",
    "bearer_matches",
    "client_interceptors",
    "token_matches",
]

logger: logging.Logger = logging.getLogger(__name__)

#: The metadata key (gRPC keys are lower case) and HTTP header that carry the token.
AUTH_HEADER = "authorization"
# A flood of refused calls is logged once in this many seconds (with a count), not per call.
_LOG_EVERY_S = 5.0


def bearer(token: str) -> str:
    """The header value that carries ``token``: ``Bearer <token>``."""
    return f"Bearer {token}"


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header (or metadata value) carries ``token``.

    Constant time in the token's contents; the scheme's case is ignored, as HTTP says.
    """
    if not header:
        return False
    scheme, _, given = header.strip().partition(" ")
    return scheme.lower() == "bearer" and token_matches(given.strip(), token)


def token_matches(given: str | None, token: str) -> bool:
    """Whether ``given`` (None or empty: none) is ``token``, in constant time in its contents."""
    if not given:
        return False
    # Bytes that were not UTF-8 arrive as surrogates: compare the bytes as sent.
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode())


class RefusalLog:
    """Logs refused requests: one line, then at most one per 5 s with a count of the others
    (a flood of bad requests must not fill the disk). Thread-safe enough: a lost count is fine.

    Args:
        log: the logger to write to (default: this module's).
    """

    def __init__(self, log: logging.Logger | None = None) -> None:
        self._logger = log or logger
        self._last = -_LOG_EVERY_S
        self._quiet = 0

    def refused(self, what: str, peer: Any, why: str) -> None:
        """Log that ``what`` (a method or path) from ``peer`` was refused because ``why``."""
        now = time.monotonic()
        if now - self._last < _LOG_EVERY_S:
            self._quiet += 1
            return
        more = f" ({self._quiet} more refused since the last line)" if self._quiet else ""
        self._logger.warning("refused %s from %s: %s%s", what, peer, why, more)
        self._last, self._quiet = now, 0


def _token_of(metadata: Sequence[Any] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class TokenGuard(grpc.aio.ServerInterceptor):
    """A server interceptor that answers ``UNAUTHENTICATED`` to calls without the job token.

    The method's own handler never runs for a refused call (nothing parsed, nothing changed).

    Args:
        token: the job token.
    """

    def __init__(self, token: str) -> None:
        self._token = token
        self._log = RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method: UNIMPLEMENTED, as without a token
        given = _token_of(handler_call_details.invocation_metadata)
        if bearer_matches(given, self._token):
            return handler
        why = "no job token" if given is None else "wrong job token"
        return _refusal(handler, handler_call_details.method, why, self._log)


def _refusal(
    handler: grpc.RpcMethodHandler, method: str, why: str, log: RefusalLog
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only refuses."""
    message = f"{why}: this server requires the job token (TORCHHEAL_TOKEN)"

    async def refuse(context: grpc.aio.ServicerContext) -> None:
        log.refused(method, context.peer(), why)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)
        yield b""  # unreachable: makes this an async generator, as a streaming handler is

    # Requests stay raw bytes: a refused call's request is never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


def _with_token(metadata: Any, value: str) -> list[tuple[str, Any]]:
    return [*(tuple(m) for m in metadata or ()), (AUTH_HEADER, value)]


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _BlockingAuth(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._value = bearer(token)

    def _details(self, details: Any) -> grpc.ClientCallDetails:
        return _Details(  # type: ignore[return-value]
            details.method,
            details.timeout,
            _with_token(details.metadata, self._value),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def client_interceptors(token: str) -> list[Any]:
    """Interceptors that send ``token`` on every call of a blocking channel
    (``grpc.intercept_channel(channel, *client_interceptors(token))``)."""
    return [_BlockingAuth(token)]


class _AioAuth:
    """Adds the token to every call of an asyncio channel. A channel files an interceptor under
    the first call kind it implements, hence one subclass per kind below."""

    def __init__(self, value: str) -> None:
        self._value = value

    async def _intercept(self, continuation: Any, details: Any, request: Any) -> Any:
        details = details._replace(metadata=_with_token(details.metadata, self._value))
        return await continuation(details, request)

    intercept_unary_unary = intercept_unary_stream = _intercept
    intercept_stream_unary = intercept_stream_stream = _intercept


class _AioUnaryUnary(_AioAuth, grpc.aio.UnaryUnaryClientInterceptor): ...


class _AioUnaryStream(_AioAuth, grpc.aio.UnaryStreamClientInterceptor): ...


class _AioStreamUnary(_AioAuth, grpc.aio.StreamUnaryClientInterceptor): ...


class _AioStreamStream(_AioAuth, grpc.aio.StreamStreamClientInterceptor): ...


def aio_client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that send ``token`` on every call of an asyncio channel
    (``grpc.aio.insecure_channel(..., interceptors=aio_client_interceptors(token))``)."""
    value = bearer(token)
    return [
        _AioUnaryUnary(value),
        _AioUnaryStream(value),
        _AioStreamUnary(value),
        _AioStreamStream(value),
    ]
