"""The lighthouse's end of a torchheal session: one stream per replica group.

A torchheal manager server opens one ``torchheal.LighthouseSession/Session`` stream to the
lighthouse and keeps it for its whole life (``session.proto``). Up the stream go a ``Hello`` (who
the stream speaks for), heartbeats and quorum requests; down come the ``Welcome``, the answers to
the requests and ``MemberLost`` notices about other groups. The stream's end is the group's death
certificate: a process that dies takes its connection with it, so the lighthouse forgets the group
at once instead of waiting out the heartbeat timeout (see ``quorum.session_ended``).

This module only parses, checks and routes messages; the lighthouse (``lighthouse.py``) owns the
state and the decisions. Every message is checked before it touches anything: a stream that
breaks the protocol (bytes that do not parse, a request before the ``Hello``, a second
``Hello``) is ended with ``INVALID_ARGUMENT``; a bad quorum request is answered with a
``QuorumFailed`` naming the problem, and the session goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.rpc.errors import StatusError
from torchheal.coordination.types import QuorumMember

__all__ = ["MAX_REPLICA_ID_BYTES", "SessionPeer", "session_handler", "validated_member"]

logger: logging.Logger = logging.getLogger(__name__)

#: Longest replica id accepted (a uuid-suffixed name is ~50 bytes; this only stops abuse).
MAX_REPLICA_ID_BYTES = 1024


class _Issued(Protocol):
    def session_event(self, request_id: int) -> bytes: ...


class _Lighthouse(Protocol):
    """What a session needs from the lighthouse (``LighthouseServer``); loop thread only."""

    def record_heartbeat(self, replica_id: str) -> None: ...

    def open_session(self, replica_id: str, peer: SessionPeer) -> int: ...

    def end_session(self, replica_id: str, peer: SessionPeer, reason: str) -> None: ...

    def withdraw(self, member: QuorumMember) -> None: ...

    async def await_quorum(self, member: QuorumMember, raw: pb.QuorumMember) -> _Issued: ...


class SessionPeer:
    """The lighthouse's handle on one live session: where to send it events.

    Events are serialized ``SessionEvent`` messages; they queue until the stream takes them.
    """

    def __init__(self) -> None:
        self._outbox: asyncio.Queue[bytes | StatusError | None] = asyncio.Queue()
        self._closed = False

    def send(self, event: bytes) -> None:
        """Queue an event for the group (dropped once the session is over)."""
        if not self._closed:
            self._outbox.put_nowait(event)

    def _finish(self, error: StatusError | None = None) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put_nowait(error)

    async def _next(self) -> bytes | StatusError | None:
        return await self._outbox.get()


def validated_member(raw: pb.QuorumMember) -> QuorumMember:
    """Check a requester for values no honest replica sends; convert it to the value type.

    Args:
        raw: the requester as received.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming the bad field.
    """
    if not raw.replica_id:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing requester.replica_id")
    if raw.step < 0:
        raise StatusError(
            grpc.StatusCode.INVALID_ARGUMENT, f"requester.step must be >= 0, got {raw.step}"
        )
    if raw.commit_failures < 0:
        raise StatusError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"requester.commit_failures must be >= 0, got {raw.commit_failures}",
        )
    # The lighthouse never reads ``data``: it is opaque here and echoed as received.
    return convert.member_from_pb(raw, strict_data=False)


class _Session:
    """Reads one stream's requests and acts on them; events go out through ``peer``."""

    def __init__(self, lighthouse: _Lighthouse, peer: SessionPeer) -> None:
        self._lighthouse = lighthouse
        self._peer = peer
        self.replica_id: str | None = None
        self.reason = "connection ended"
        self._request: asyncio.Task[None] | None = None

    async def read(self, requests: AsyncIterator[bytes]) -> None:
        """Consume the stream until it ends, the group says goodbye, or it breaks the protocol."""
        try:
            async for raw in requests:
                if not self._handle(raw):
                    break
        except StatusError as e:
            self._peer._finish(e)
            return
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        self._peer._finish()

    def close(self) -> None:
        """The stream is over: stop the pending request and tell the lighthouse."""
        if self._request is not None:
            self._request.cancel()
        if self.replica_id is not None:
            self._lighthouse.end_session(self.replica_id, self._peer, self.reason)

    def _handle(self, raw: bytes) -> bool:
        """Act on one request; False when the group said goodbye."""
        try:
            request = spb.SessionRequest.FromString(raw)
        except DecodeError as e:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse SessionRequest: {e}"
            ) from None
        kind = request.WhichOneof("kind")
        if self.replica_id is None:
            if kind != "hello":
                raise StatusError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a session must start with hello, got {kind or 'an empty request'}",
                )
            self._hello(request.hello)
        elif kind == "heartbeat":
            self._lighthouse.record_heartbeat(self.replica_id)
        elif kind == "quorum":
            self._quorum(request.quorum)
        elif kind == "goodbye":
            self.reason = f"left: {request.goodbye.reason}" if request.goodbye.reason else "left"
            return False
        elif kind == "hello":
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "hello sent twice")
        else:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "empty SessionRequest")
        return True

    def _hello(self, hello: spb.Hello) -> None:
        replica_id = hello.replica_id
        if not replica_id:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "hello.replica_id is empty")
        if len(replica_id.encode()) > MAX_REPLICA_ID_BYTES:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"hello.replica_id is longer than {MAX_REPLICA_ID_BYTES} bytes",
            )
        if hello.protocol < 1:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"hello.protocol must be >= 1, got {hello.protocol}",
            )
        self.replica_id = replica_id
        quorum_id = self._lighthouse.open_session(replica_id, self._peer)
        self._peer.send(
            spb.SessionEvent(
                welcome=spb.Welcome(protocol=methods.SESSION_PROTOCOL, quorum_id=quorum_id)
            ).SerializeToString()
        )

    def _quorum(self, request: spb.QuorumRequest) -> None:
        request_id = request.request_id
        try:
            if not request.HasField("requester"):
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing requester")
            raw = request.requester
            member = validated_member(raw)
            if member.replica_id != self.replica_id:
                raise StatusError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"requester.replica_id {member.replica_id!r} is not this session's "
                    f"({self.replica_id!r}): a session speaks for its own group only",
                )
            if request.timeout_ms <= 0:
                raise StatusError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"timeout_ms must be > 0, got {request.timeout_ms}",
                )
        except StatusError as e:
            self._peer.send(_failed(request_id, e.code, e.details))
            return
        if self._request is not None:
            # One request per group at a time: the newer one stands for the group now.
            self._request.cancel()
        self._request = asyncio.ensure_future(
            self._await(request_id, member, raw, request.timeout_ms / 1000.0)
        )

    async def _await(
        self, request_id: int, member: QuorumMember, raw: pb.QuorumMember, timeout_s: float
    ) -> None:
        try:
            issued = await asyncio.wait_for(self._lighthouse.await_quorum(member, raw), timeout_s)
        except asyncio.TimeoutError:
            self._lighthouse.withdraw(member)
            self._peer.send(
                _failed(
                    request_id,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no quorum within the request's {timeout_s:.3f}s",
                )
            )
            return
        except asyncio.CancelledError:
            self._lighthouse.withdraw(member)
            raise
        self._peer.send(issued.session_event(request_id))


def _failed(request_id: int, code: grpc.StatusCode, message: str) -> bytes:
    return spb.SessionEvent(
        failed=spb.QuorumFailed(request_id=request_id, code=code.value[0], message=message)
    ).SerializeToString()


def session_handler(lighthouse: _Lighthouse) -> grpc.RpcMethodHandler:
    """The gRPC handler of ``torchheal.LighthouseSession/Session`` for ``lighthouse``.

    Args:
        lighthouse: the lighthouse the sessions talk to.
    """

    async def serve(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        peer = SessionPeer()
        session = _Session(lighthouse, peer)
        reader = asyncio.ensure_future(session.read(requests))
        try:
            while True:
                event = await peer._next()
                if event is None:
                    return
                if isinstance(event, StatusError):
                    logger.info(
                        "ending session of %s: %s", session.replica_id or "(no hello)", event
                    )
                    await context.abort(event.code, event.details)
                yield event
        finally:
            reader.cancel()
            session.close()

    return grpc.stream_stream_rpc_method_handler(
        serve, request_deserializer=None, response_serializer=None
    )
