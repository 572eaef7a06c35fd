"""The lighthouse's end of a torchheal session, whatever carries it (gRPC stream or TCP lane).

A manager server keeps one session for its life (``session.proto``); its end tells the lighthouse
at once that the group is gone. A *detached* session (a ``LighthouseClient``'s) speaks for no
group and only carries requests. :class:`SessionProtocol` parses, checks and routes one session's
messages for every transport; :func:`session_handler` serves it as a gRPC stream. Breaking the
protocol ends a session with ``INVALID_ARGUMENT``; a bad request only gets a ``QuorumFailed``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.splice import uint_field, varint
from torchheal.coordination import convert
from torchheal.coordination.rpc.errors import StatusError
from torchheal.coordination.types import QuorumMember

__all__ = [
    "MAX_REPLICA_ID_BYTES",
    "Peer",
    "SessionProtocol",
    "check_replica_id",
    "failed_event",
    "session_handler",
    "validated_member",
]

# A child of the lighthouse's logger, so configuring that one configures the whole lighthouse.
logger: logging.Logger = logging.getLogger("torchheal.coordination.lighthouse.session")

#: Longest replica id accepted (a uuid-suffixed name is ~50 bytes; this only stops abuse).
MAX_REPLICA_ID_BYTES = 1024
#: What is kept of a ``GaveUp``'s reason (it is logged and passed on to every group).
MAX_REASON_CHARS = 500

# SessionEvent field 5 (HeartbeatAck), length-delimited.
_ACK_TAG = varint(5 << 3 | 2)


class Peer(Protocol):
    """Where a session's events go (serialized ``SessionEvent`` messages)."""

    def send(self, event: bytes) -> None: ...


class _Issued(Protocol):
    def session_event(self, request_id: int) -> bytes: ...


class _Lighthouse(Protocol):
    """What a session needs from the lighthouse (``LighthouseServer``); loop thread only."""

    @property
    def heartbeat_timeout_ms(self) -> int: ...

    def record_heartbeat(self, replica_id: str) -> None: ...

    def open_session(
        self, replica_id: str, peer: Peer, last_quorum: pb.Quorum | None = None
    ) -> int: ...

    def missed_notice(self, replica_id: str, last_quorum: pb.Quorum | None) -> bytes | None: ...

    def end_session(
        self, replica_id: str, peer: Peer, reason: str, steps_done: int = 0
    ) -> None: ...

    def gave_up(self, replica_id: str, peer: Peer, quorum_id: int, reason: str) -> None: ...

    def wait_for_quorum(
        self,
        member: QuorumMember,
        raw: pb.QuorumMember,
        deliver: Callable[[Any], None],
        timeout_s: float,
        expired: Callable[[], None],
        lineage: int = 0,
    ) -> Any: ...

    def withdraw(self, request: Any) -> None: ...

    def decide_if_due(self) -> None: ...


def validated_member(raw: pb.QuorumMember) -> QuorumMember:
    """Check a requester for values no honest replica sends (``StatusError`` naming the field);
    convert it to the value type."""
    check_replica_id(raw.replica_id, "requester.replica_id", "missing requester.replica_id")
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


def failed_event(request_id: int, code: grpc.StatusCode, message: str) -> bytes:
    """The serialized ``SessionEvent`` refusing request (or heartbeat ack) ``request_id``."""
    return spb.SessionEvent(
        failed=spb.QuorumFailed(request_id=request_id, code=code.value[0], message=message)
    ).SerializeToString()


def _ack_event(ack: int) -> bytes:
    inner = uint_field(1, ack)
    return _ACK_TAG + varint(len(inner)) + inner


def check_replica_id(replica_id: str, what: str, missing: str = "") -> None:
    """Refuse an empty (``missing``, default "{what} is empty") or overlong replica id."""
    if not replica_id:
        raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, missing or f"{what} is empty")
    if len(replica_id.encode()) > MAX_REPLICA_ID_BYTES:
        # Ids are kept for a minute after the last request: unbounded, a few fill memory.
        raise StatusError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} is longer than {MAX_REPLICA_ID_BYTES} bytes",
        )


class SessionProtocol:
    """One session's requests, acted on; its events go out through ``peer``."""

    def __init__(self, lighthouse: _Lighthouse, peer: Peer) -> None:
        self._lighthouse = lighthouse
        self._peer = peer
        self.replica_id: str | None = None
        self.detached = False
        self.reason = "connection ended"
        self.steps_done = 0  # said in the goodbye: see session.proto's Goodbye
        # request id -> its pending quorum request (at most one unless detached).
        self._pending: dict[int, Any] = {}

    def handle(self, raw: bytes) -> bool:
        """Act on one request; False once the group said goodbye. A :class:`StatusError` means
        the session broke the protocol and must end with it."""
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
            self._heartbeat(request.heartbeat)
        elif kind == "quorum":
            self._quorum(request.quorum)
        elif kind == "goodbye":
            self.reason = f"left: {request.goodbye.reason}" if request.goodbye.reason else "left"
            self.steps_done = max(0, request.goodbye.steps_done)
            return False
        elif kind == "gave_up":
            self._gave_up(request.gave_up)
        elif kind == "hello":
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "hello sent twice")
        else:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "empty SessionRequest")
        return True

    def close(self) -> None:
        """The session is over: withdraw its pending requests and tell the lighthouse."""
        pending, self._pending = self._pending, {}
        for waiter in pending.values():
            self._lighthouse.withdraw(waiter)
        if self.replica_id is not None and not self.detached:
            self._lighthouse.end_session(self.replica_id, self._peer, self.reason, self.steps_done)

    def _hello(self, hello: spb.Hello) -> None:
        check_replica_id(hello.replica_id, "hello.replica_id")
        if hello.protocol < 1:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"hello.protocol must be >= 1, got {hello.protocol}",
            )
        self.replica_id = hello.replica_id
        self.detached = hello.detached
        missed = None
        if self.detached:
            quorum_id = 0
            logger.debug("detached session %s opened", self.replica_id)
        else:
            # A restarted lighthouse learns the ids in use from it (quorum.restore); a
            # malformed one is ignored: it only protects the group that sends it.
            last = hello.last_quorum if hello.HasField("last_quorum") else None
            quorum_id = self._lighthouse.open_session(self.replica_id, self._peer, last)
            missed = self._lighthouse.missed_notice(self.replica_id, last)
        self._peer.send(
            spb.SessionEvent(
                welcome=spb.Welcome(
                    protocol=methods.SESSION_PROTOCOL,
                    quorum_id=quorum_id,
                    heartbeat_timeout_ms=self._lighthouse.heartbeat_timeout_ms,
                )
            ).SerializeToString()
        )
        if missed is not None:  # after the Welcome: the group was dropped while away
            self._peer.send(missed)

    def _gave_up(self, gave_up: spb.GaveUp) -> None:
        if self.detached or self.replica_id is None:
            return  # it speaks for no group: there is nobody to announce
        if gave_up.quorum_id <= 0:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"gave_up.quorum_id must be > 0, got {gave_up.quorum_id}",
            )
        reason = gave_up.reason[:MAX_REASON_CHARS]
        self._lighthouse.gave_up(self.replica_id, self._peer, gave_up.quorum_id, reason)

    def _heartbeat(self, heartbeat: spb.Heartbeat) -> None:
        replica_id = heartbeat.replica_id
        try:
            if self.detached:
                check_replica_id(replica_id, "heartbeat.replica_id")
            elif replica_id and replica_id != self.replica_id:
                raise StatusError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"heartbeat.replica_id {replica_id!r} is not this session's "
                    f"({self.replica_id!r}): a session speaks for its own group only",
                )
        except StatusError as e:
            if not heartbeat.ack:
                raise  # nobody to answer: the sender is broken, end the session
            self._peer.send(failed_event(heartbeat.ack, e.code, e.details))
            return
        self._lighthouse.record_heartbeat(replica_id or self.replica_id or "")
        if heartbeat.ack:
            self._peer.send(_ack_event(heartbeat.ack))

    def _quorum(self, request: spb.QuorumRequest) -> None:
        request_id = request.request_id
        try:
            if not request.HasField("requester"):
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing requester")
            raw = request.requester
            member = validated_member(raw)
            if not self.detached and member.replica_id != self.replica_id:
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
            self._peer.send(failed_event(request_id, e.code, e.details))
            return
        # One request per group at a time (the newer one stands for the group now); a
        # detached session may have several, but one per request id.
        if self.detached:
            old = self._pending.pop(request_id, None)
            stale = [] if old is None else [old]
        else:
            stale = list(self._pending.values())
            self._pending.clear()
        for waiter in stale:
            self._lighthouse.withdraw(waiter)
        timeout_s = request.timeout_ms / 1000.0
        self._pending[request_id] = self._lighthouse.wait_for_quorum(
            member,
            raw,
            lambda issued: self._answer(request_id, issued),
            timeout_s,
            lambda: self._expired(request_id, timeout_s),
            max(0, request.lineage),
        )

    def _answer(self, request_id: int, issued: _Issued) -> None:
        self._pending.pop(request_id, None)
        self._peer.send(issued.session_event(request_id))

    def _expired(self, request_id: int, timeout_s: float) -> None:
        self._pending.pop(request_id, None)
        self._peer.send(
            failed_event(
                request_id,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no quorum within the request's {timeout_s:.3f}s",
            )
        )


class _StreamPeer:
    """A gRPC session's outbox: events queue until the stream takes them."""

    def __init__(self) -> None:
        self._outbox: asyncio.Queue[bytes | StatusError | None] = asyncio.Queue()
        self._closed = False

    def send(self, event: bytes) -> None:
        """Queue an event (dropped once the session is over)."""
        if not self._closed:
            self._outbox.put_nowait(event)

    def finish(self, error: StatusError | None = None) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put_nowait(error)

    async def next(self) -> bytes | StatusError | None:
        return await self._outbox.get()


async def _read(
    lighthouse: _Lighthouse,
    session: SessionProtocol,
    peer: _StreamPeer,
    requests: AsyncIterator[bytes],
) -> None:
    """Consume a stream until it ends, the group says goodbye, or it breaks the protocol."""
    try:
        async for raw in requests:
            if not session.handle(raw):
                break
            lighthouse.decide_if_due()
    except StatusError as e:
        peer.finish(e)
        return
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        pass
    peer.finish()


def session_handler(lighthouse: _Lighthouse) -> grpc.RpcMethodHandler:
    """The gRPC handler of ``torchheal.LighthouseSession/Session`` for ``lighthouse``."""

    async def serve(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        peer = _StreamPeer()
        session = SessionProtocol(lighthouse, peer)
        reader = asyncio.ensure_future(_read(lighthouse, session, peer, requests))
        try:
            while True:
                event = await peer.next()
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
