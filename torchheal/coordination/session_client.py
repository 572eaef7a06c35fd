"""The client's end of a torchheal session with the lighthouse (``session.proto``), without I/O.

Two shells carry bytes and time to it: a manager server's link (``group/link*.py``, asyncio,
reopened for its group) and a blocking client's detached session (``clients/direct_session.py``).
The rules live here: hello and welcome, request ids, which waiter an answer settles, heartbeat
acks, silence, failing every pending request when a session breaks, what the next one says.

No sockets, tasks, threads, locks or clock reads (``now`` is passed in). A pending request is the
shell's own *waiter* (a future, a slot), handed back when settled or when the session ends; a shell
sharing a session between threads holds its lock around each call.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic, NamedTuple, TypeVar

import grpc
from google.protobuf.message import DecodeError

from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb

__all__ = [
    "MAX_EVENT_BYTES",
    "SILENT_SESSION_S",
    "Answer",
    "Ended",
    "Lost",
    "Refused",
    "SessionClient",
    "Welcomed",
    "heartbeat_request",
    "issued_quorum",
    "quorum_request",
]

#: A quorum event carries every member of the job: far more than a request.
MAX_EVENT_BYTES = 256 * 1024 * 1024
#: A session silent this long is taken for dead: the reference's heartbeat timeout, after which
#: the lighthouse has given the group up anyway. Heartbeats ask for an ack after a quarter of it.
SILENT_SESSION_S = 5.0

W = TypeVar("W")

_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}


def _status(code: int) -> grpc.StatusCode:
    return _STATUS_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)


class Refused(NamedTuple):
    """A request the lighthouse refused or timed out (``QuorumFailed``): the gRPC status it
    stands for and the lighthouse's reason."""

    code: grpc.StatusCode
    message: str


class Answer(NamedTuple):
    """An event settled a pending request: complete ``waiter`` with ``value``.

    ``value`` is :class:`Refused`, else the issued ``torchft.Quorum`` on a group's session and
    the serialized ``SessionEvent`` on a detached one (whose caller decodes what it asked for).
    """

    waiter: Any
    value: Any


class Welcomed(NamedTuple):
    """The lighthouse welcomed the session (its fields are kept on the :class:`SessionClient`);
    ``waiter`` is the hello's, when one waited for it as request 0."""

    waiter: Any
    welcome: spb.Welcome


class Lost(NamedTuple):
    """A ``MemberLost`` notice; ``ours``: it is about this session's own group."""

    notice: spb.MemberLost
    ours: bool


class Ended(NamedTuple):
    """The session is over by the lighthouse's word (``SessionClosed``) or its bytes."""

    code: grpc.StatusCode
    message: str
    reason: str


def heartbeat_request(replica_id: str, ack: int) -> bytes:
    """A serialized ``SessionRequest``: a heartbeat of ``replica_id`` (``""``: the session's own
    group) that asks for the acknowledgement ``ack``."""
    heartbeat = spb.Heartbeat(replica_id=replica_id, ack=ack)
    return spb.SessionRequest(heartbeat=heartbeat).SerializeToString()


def quorum_request(
    request_id: int,
    replica_id: str,
    address: str,
    store_address: str,
    step: int,
    world_size: int,
    shrink_only: bool,
    data: str,
    timeout_ms: int,
) -> bytes:
    """A serialized ``SessionRequest`` carrying a detached client's quorum request (``data``:
    the member's data as on the wire, JSON text or ``""``)."""
    requester = pb.QuorumMember(
        replica_id=replica_id,
        address=address,
        store_address=store_address,
        step=step,
        world_size=world_size,
        shrink_only=shrink_only,
        data=data,
    )
    request = spb.QuorumRequest(request_id=request_id, requester=requester, timeout_ms=timeout_ms)
    return spb.SessionRequest(quorum=request).SerializeToString()


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def issued_quorum(event: bytes) -> tuple[int, bytes] | None:
    """``(request_id, serialized torchft.Quorum)`` of a serialized ``QuorumIssued`` event.

    Read without parsing, so clients in one process decode a quorum's bytes once between them;
    None when not laid out as the lighthouse writes one (the caller then parses it in full).
    """
    try:
        if not event or event[0] != 0x12:  # field 2 (quorum), length-delimited
            return None
        length, pos = _varint_at(event, 1)
        if pos + length != len(event):
            return None
        request_id = 0
        quorum = b""
        end = len(event)
        while pos < end:
            tag, pos = _varint_at(event, pos)
            if tag == 0x08:  # request_id
                request_id, pos = _varint_at(event, pos)
            elif tag == 0x12:  # quorum
                size, pos = _varint_at(event, pos)
                if pos + size > end:
                    return None
                quorum = event[pos : pos + size]
                pos += size
            else:
                return None
        return request_id, quorum
    except (IndexError, ValueError):
        return None


class SessionClient(Generic[W]):
    """One client's session state, kept across reopenings (a group's link reuses it).

    Args:
        label: the group's full id (a detached session's label, for the lighthouse's logs).
        detached: a session that speaks for no group (``Hello.detached``).
        silent_s: how long a session may carry nothing before it counts as broken (> 0).
        last_quorum_id: the last quorum id an earlier process of this group received (0: none),
            told in the hello until a quorum comes.
    """

    def __init__(
        self,
        label: str,
        *,
        detached: bool = False,
        silent_s: float = SILENT_SESSION_S,
        last_quorum_id: int = 0,
    ) -> None:
        if not silent_s > 0:
            raise ValueError(f"silent_s must be > 0, got {silent_s!r}")
        self.label = label
        self.detached = detached
        self.silent_s = silent_s
        #: The session protocol of the lighthouse's last welcome (0: none yet).
        self.protocol = 0
        #: Whether the job was already running when the first session opened (None: no welcome
        #: yet). Any quorum id says so: the job ran, or restarted with its groups.
        self.joined_running: bool | None = None
        #: The lighthouse's heartbeat timeout, from the latest welcome that said it.
        self.heartbeat_timeout_s: float | None = None
        #: The last quorum received, told in every hello: a restarted lighthouse must never
        #: issue an id that goes backwards or repeats (quorum.restore).
        self.last_quorum: pb.Quorum | None = (
            pb.Quorum(quorum_id=last_quorum_id) if last_quorum_id > 0 else None
        )
        #: The quorum whose history the group holds (told with every request, so a lighthouse
        #: can tell a history it superseded: quorum.superseded).
        self.lineage = 0
        #: Steps committed while between two steps (0: in a step), said in the goodbye so that
        #: peers still in the step it finished keep their collectives with it.
        self.steps_done = 0
        #: Why the session ended (None while it lasts); the first reason is kept.
        self.ended: str | None = None
        self._heard_at = 0.0
        self._pending: dict[int, W] = {}
        self._ids = itertools.count(1)  # a C iterator: next() is atomic under the GIL
        self._beat = spb.SessionRequest(heartbeat=spb.Heartbeat()).SerializeToString()

    # ------------------------------------------------------------------------------------------
    # Sending

    def hello(self, now: float, token: str = "") -> bytes:
        """A new session starts: the hello to send. Silence counts from ``now``; ``token`` is
        for the direct lane only (a gRPC stream carries it as metadata)."""
        self.ended = None
        self._heard_at = now
        hello = spb.Hello(
            replica_id=self.label,
            protocol=methods.SESSION_PROTOCOL,
            detached=self.detached,
            token=token,
            last_quorum=self.last_quorum,
        )
        return spb.SessionRequest(hello=hello).SerializeToString()

    def next_id(self) -> int:
        """A fresh request id."""
        return next(self._ids)

    def expect(self, request_id: int, waiter: W) -> None:
        """``waiter`` waits for the answer to ``request_id`` (0: the hello's welcome)."""
        self._pending[request_id] = waiter

    def withdraw(self, request_id: int) -> None:
        """Nobody waits for ``request_id`` any more: a late answer is dropped."""
        self._pending.pop(request_id, None)

    def quorum_request(
        self, requester: pb.QuorumMember, timeout_s: float, waiter: W
    ) -> tuple[int, bytes]:
        """A group's quorum request, with its history, that ``waiter`` waits on: (id, bytes)."""
        request_id = self.next_id()
        self._pending[request_id] = waiter
        request = spb.QuorumRequest(
            request_id=request_id,
            requester=requester,
            timeout_ms=max(1, int(timeout_s * 1000)),
            lineage=self.lineage,
        )
        return request_id, spb.SessionRequest(quorum=request).SerializeToString()

    def heartbeat(self, now: float) -> bytes:
        """The group's next heartbeat: one that asks for an acknowledgement once the lighthouse
        has been quiet for a quarter of the silence limit (no quorum round in flight)."""
        if now - self._heard_at >= self.silent_s / 4:
            return heartbeat_request("", self.next_id())
        return self._beat

    def gave_up(self, quorum_id: int, reason: str) -> bytes | None:
        """A ``GaveUp`` for quorum ``quorum_id``; None to a lighthouse older than protocol 2,
        which would end the session."""
        if self.protocol < 2:
            return None
        message = spb.GaveUp(quorum_id=quorum_id, reason=reason)
        return spb.SessionRequest(gave_up=message).SerializeToString()

    def goodbye(self, reason: str) -> bytes:
        """The group leaves on purpose, saying the steps it had done."""
        message = spb.Goodbye(reason=reason, steps_done=self.steps_done)
        return spb.SessionRequest(goodbye=message).SerializeToString()

    def asked(self) -> None:
        """The group asked for a quorum: it is in a step, so a goodbye says no steps done."""
        self.steps_done = 0

    def holds_last_quorum(self, steps_done: int = 0) -> None:
        """The group holds the last quorum's history: it committed ``steps_done`` steps in it,
        or healed in it from a peer that holds it."""
        self.steps_done = steps_done
        last = self.last_quorum
        if last is not None and last.participants:
            self.lineage = last.quorum_id

    # ------------------------------------------------------------------------------------------
    # Receiving

    def silence(self, now: float) -> float | None:
        """How long the session has carried nothing, once that reaches the limit (it counts as
        broken: a partition drops packets without a FIN or RST); None before."""
        quiet = now - self._heard_at
        return quiet if quiet >= self.silent_s else None

    def receive(self, event: bytes, now: float = 0.0) -> Answer | Welcomed | Lost | Ended | None:
        """What one serialized ``SessionEvent``, come at ``now``, means; None: nothing to do (an
        answer nobody waits for, a kind this client does not use)."""
        self._heard_at = now
        try:
            issued = issued_quorum(event)
            if issued is not None:
                return self._issued(issued[0], issued[1], event)
            parsed = spb.SessionEvent.FromString(event)
        except DecodeError as e:
            why = f"the lighthouse sent an event that does not parse: {e}"
            return Ended(grpc.StatusCode.INTERNAL, why, why)
        kind = parsed.WhichOneof("kind")
        if kind == "quorum":
            return self._issued(parsed.quorum.request_id, parsed.quorum.quorum, event)
        if kind == "heartbeat_ack":
            return self._settle(parsed.heartbeat_ack.ack, event)
        if kind == "failed":
            refused = Refused(_status(parsed.failed.code), parsed.failed.message)
            return self._settle(parsed.failed.request_id, refused)
        if kind == "welcome":
            return self._welcomed(parsed.welcome)
        if kind == "lost":
            return Lost(parsed.lost, not self.detached and parsed.lost.replica_id == self.label)
        if kind == "closed":
            code = _status(parsed.closed.code)
            message = parsed.closed.message
            return Ended(code, message, f"the lighthouse ended the session: {code.name}: {message}")
        return None  # a newer kind: not for this client

    def end(self, why: str) -> list[W]:
        """The session is over (broken, closed, silent, hung up): the waiters of every pending
        request, each to fail. The first reason is kept until the next hello."""
        if self.ended is None:
            self.ended = why
        waiters = list(self._pending.values())
        self._pending.clear()
        return waiters

    def _settle(self, request_id: int, value: Any) -> Answer | None:
        waiter = self._pending.pop(request_id, None)
        if waiter is None:
            return None  # an answer to a request nobody waits for any more
        return Answer(waiter, value)

    def _issued(self, request_id: int, quorum: bytes | pb.Quorum, event: bytes) -> Answer | None:
        if self.detached or request_id not in self._pending:
            return self._settle(request_id, event)
        if isinstance(quorum, bytes):
            quorum = pb.Quorum.FromString(quorum)
        if self.last_quorum is None or quorum.quorum_id >= self.last_quorum.quorum_id:
            self.last_quorum = quorum
        return self._settle(request_id, quorum)

    def _welcomed(self, welcome: spb.Welcome) -> Welcomed:
        self.protocol = welcome.protocol
        if self.joined_running is None:
            self.joined_running = welcome.quorum_id > 0
        if welcome.heartbeat_timeout_ms > 0:
            self.heartbeat_timeout_s = welcome.heartbeat_timeout_ms / 1000.0
        return Welcomed(self._pending.pop(0, None), welcome)
