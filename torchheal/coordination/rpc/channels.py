"""Client side of gRPC: channels with the reference's connection settings, and unary calls.

:func:`connect` and :func:`aio_connect` wait until the channel is ready (``RuntimeError`` when
the server cannot be reached in time); channels send the job token and speak TLS as the caller's
``security`` says (``docs/security.md``). :class:`UnaryCaller` maps failures via ``errors.py``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import Message

from torchheal._base.security import SecurityEnv
from torchheal._base.timeouts import to_seconds
from torchheal._wire.methods import Method
from torchheal.coordination.rpc.addresses import format_target, parse_address
from torchheal.coordination.rpc.auth import aio_client_interceptors, client_interceptors
from torchheal.coordination.rpc.errors import rpc_error_to_exception
from torchheal.coordination.rpc.tls import channel_credentials

__all__ = ["CHANNEL_OPTIONS", "UnaryCaller", "aio_connect", "connect", "serialize"]

# Connection settings of the reference (§3.3); gRPC's own reconnect loop plays the part of the
# reference's connect retries.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 10_000),
]


def connect(addr: str, connect_timeout: timedelta | float, security: SecurityEnv) -> grpc.Channel:
    """Open a blocking channel (thread-safe) and wait until it is connected.

    Raises:
        ValueError: the address or the security settings are malformed.
        RuntimeError: the server could not be reached within ``connect_timeout``.
    """
    target = format_target(*parse_address(addr))
    timeout_s = to_seconds(connect_timeout)
    if security.tls:
        channel = grpc.secure_channel(
            target, channel_credentials(security), options=CHANNEL_OPTIONS
        )
    else:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    if security.token is not None:
        channel = grpc.intercept_channel(channel, *client_interceptors(security.token))
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise RuntimeError(
            f"failed to connect to {addr} within timeout of {timeout_s:g}s; "
            "verify the address and that the server is running"
        ) from None
    return channel


async def aio_connect(
    addr: str, connect_timeout: timedelta | float, security: SecurityEnv
) -> grpc.aio.Channel:
    """Open an asyncio channel and wait until it is connected (errors as :func:`connect`)."""
    target = format_target(*parse_address(addr))
    timeout_s = to_seconds(connect_timeout)
    interceptors = None if security.token is None else aio_client_interceptors(security.token)
    if security.tls:
        channel = grpc.aio.secure_channel(
            target,
            channel_credentials(security),
            options=CHANNEL_OPTIONS,
            interceptors=interceptors,
        )
    else:
        channel = grpc.aio.insecure_channel(
            target, options=CHANNEL_OPTIONS, interceptors=interceptors
        )
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except asyncio.TimeoutError:
        await channel.close()
        raise RuntimeError(
            f"failed to connect to {addr} within timeout of {timeout_s:g}s; "
            "verify the address and that the server is running"
        ) from None
    except BaseException:
        # Cancelled (a heal whose source was lost): a channel left open on a loop that is
        # about to close would have grpc call into the closed loop later.
        await channel.close()
        raise
    return channel


class UnaryCaller:
    """A blocking unary method bound to a channel, with deadlines and error mapping; thread-safe.

    Args:
        channel: a blocking channel.
        method: the method to call.
        target: the server address, for error messages.
    """

    def __init__(self, channel: grpc.Channel, method: Method, target: str) -> None:
        self._method = method
        self._what = f"{method.service.removeprefix('torchft.')}/{method.name} to {target}"
        self._call = channel.unary_unary(
            method.path,
            request_serializer=serialize,
            response_deserializer=method.response.FromString,
        )

    def __call__(self, request: Message, timeout: timedelta | float) -> Any:
        """Send ``request``; wait at most ``timeout`` (sent as ``grpc-timeout``) for the response.

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


def serialize(message: Message | bytes) -> bytes:
    """A message's wire bytes; bytes (serialized once for many callers) pass through."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()
