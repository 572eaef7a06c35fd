"""A blocking client's session with the lighthouse, on its direct TCP lane.

:class:`DirectSession` is what a :class:`~torchheal.coordination.clients.lighthouse_client.LighthouseClient` talks
through when the lighthouse is torchheal's: one TCP connection (``lighthouse/tcp.py``) carrying
a *detached* session (it speaks for no group, so closing it declares nobody dead; see
``session.proto``), on which heartbeats and quorum requests of any replica travel as
length-delimited ``SessionRequest`` messages and come back answered by id.

It needs no thread and no event loop of its own: a caller sends its request and then reads the
connection itself until its answer arrives, handing other callers' answers to them on the way;
while one caller reads, the others wait for it to hand over (leader and followers). A single
caller pays one ``send`` and one ``recv``, which is what makes the lane cheap.

Errors are data: a refused or timed-out request comes back as :class:`Refused` (a gRPC status
code and message, which the client words as the reference does); a connection that breaks
fails every waiting call with :class:`SessionBroken`, and the session is not used again.

With a job token the hello carries it (``docs/security.md``); with TLS on, the lighthouse opens
no lane and the client never gets here.
"""

from __future__ import annotations

import itertools
import math
import socket
import struct
import threading
import time
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError

from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.splice import int_field, message_field, uint_field
from torchheal.coordination.rpc.frames import FrameError, FrameReader, frame

__all__ = [
    "DirectSession",
    "Refused",
    "SessionBroken",
    "heartbeat_ack",
    "heartbeat_request",
    "issued_quorum",
    "quorum_request",
]

# A quorum event carries every member of the job: allow far more than a request.
MAX_EVENT_BYTES = 256 * 1024 * 1024
# The most one read takes. Below glibc's mmap threshold (128 KiB): recv() allocates a bytes of
# this size before shrinking it to what arrived, and one of 256 KiB was an mmap/munmap pair per
# read (17-40 us here, against 3 us for the whole recv of a small answer).
_RECV_BYTES = 64 * 1024
_STATUS_BY_VALUE = {status.value[0]: status for status in grpc.StatusCode}
_ACK_TAG = 5 << 3 | 2  # SessionEvent.heartbeat_ack, length-delimited


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` for SO_RCVTIMEO/SO_SNDTIMEO (at least 1 ms: 0 would mean forever)."""
    micros = max(1000, math.ceil(seconds * 1e6))
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


class SessionBroken(ConnectionError):
    """The connection to the lighthouse broke (or the lighthouse ended the session)."""


class Refused(NamedTuple):
    """A request the lighthouse refused or timed out.

    Args:
        code: the gRPC status it stands for.
        message: the lighthouse's reason.
    """

    code: grpc.StatusCode
    message: str


class _Slot:
    """Where one call's answer lands."""

    __slots__ = ("answer", "done")

    def __init__(self) -> None:
        self.done = False
        self.answer: bytes | Refused | SessionBroken | None = None


def heartbeat_request(replica_id: str, ack: int) -> bytes:
    """A serialized ``SessionRequest`` carrying an acknowledged heartbeat of ``replica_id``.

    Built from bytes (the hot path of a heartbeating client); equal to the generated class's
    serialization.

    Args:
        replica_id: whose heartbeat.
        ack: the id the lighthouse answers with.
    """
    body = message_field(1, replica_id.encode()) if replica_id else b""
    return message_field(2, body + uint_field(2, ack))


_INT64 = range(-(1 << 63), 1 << 63)
_UINT64 = range(1 << 64)


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
    """A serialized ``SessionRequest`` carrying a quorum request.

    Built from bytes (the client's hot path: two messages built and serialized cost ~8 us of
    the caller's time, these bytes ~3 us); equal to the generated classes' serialization, which
    is used instead for anything but plain ``str``/``int``/``bool`` values in range (and raises
    what it raises for bad ones).

    Args:
        request_id: the id the lighthouse answers with.
        replica_id: the requester's replica group.
        address: its manager's address.
        store_address: its store's address.
        step: its step.
        world_size: its number of ranks.
        shrink_only: whether it only accepts a quorum that drops members.
        data: its ``data`` as on the wire (JSON text or ``""``).
        timeout_ms: how long it waits for a quorum.
    """
    if (
        type(replica_id) is str
        and type(address) is str
        and type(store_address) is str
        and type(data) is str
        and type(step) is int
        and type(world_size) is int
        and type(timeout_ms) is int
        and type(request_id) is int
        and type(shrink_only) is bool
        and step in _INT64
        and timeout_ms in _INT64
        and world_size in _UINT64
        and request_id in _UINT64
    ):
        try:
            member = b"".join(
                (
                    message_field(1, replica_id.encode()) if replica_id else b"",
                    message_field(2, address.encode()) if address else b"",
                    message_field(3, store_address.encode()) if store_address else b"",
                    int_field(4, step),
                    uint_field(5, world_size),
                    b"\x30\x01" if shrink_only else b"",  # field 6, true
                    message_field(7, data.encode()) if data else b"",
                )
            )
        except UnicodeError:  # a lone surrogate: the generated class says what is wrong
            pass
        else:
            inner = uint_field(1, request_id) + message_field(2, member) + int_field(3, timeout_ms)
            return message_field(3, inner)
    requester = pb.QuorumMember(
        replica_id=replica_id,
        address=address,
        store_address=store_address,
        step=step,
        world_size=world_size,
        shrink_only=shrink_only,
        data=data,
    )
    return spb.SessionRequest(
        quorum=spb.QuorumRequest(request_id=request_id, requester=requester, timeout_ms=timeout_ms)
    ).SerializeToString()


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


def heartbeat_ack(event: bytes) -> int | None:
    """The id of a ``HeartbeatAck`` event, read without a parse (the most frequent answer);
    None when ``event`` is not laid out as the lighthouse writes one.

    Args:
        event: a serialized ``SessionEvent``.
    """
    # field 5 (heartbeat_ack), its length, field 1 (ack) as a varint, and nothing else.
    if len(event) < 4 or event[0] != _ACK_TAG or event[2] != 0x08 or event[1] != len(event) - 2:
        return None
    try:
        ack, end = _varint_at(event, 3)
    except (IndexError, ValueError):
        return None
    return ack if end == len(event) else None


def issued_quorum(event: bytes) -> tuple[int, bytes] | None:
    """``(request_id, serialized torchft.Quorum)`` of a ``QuorumIssued`` event, read without
    parsing the quorum; None when ``event`` is not laid out as the lighthouse writes one (the
    caller then parses it in full).

    Args:
        event: a serialized ``SessionEvent``.
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


class DirectSession:
    """A detached session on the lighthouse's direct lane; safe to share between threads.

    Args:
        host: the lighthouse's host.
        port: its direct lane's port.
        label: names the session in the lighthouse's logs.
        timeout_s: how long connecting and the lighthouse's welcome may take.
        security: the job token to send (default: read from the environment).

    Raises:
        OSError: the lane could not be reached.
        SessionBroken: the lighthouse refused the session (a missing or wrong job token, too).
    """

    def __init__(
        self,
        host: str,
        port: int,
        label: str,
        timeout_s: float,
        security: SecurityEnv | None = None,
    ) -> None:
        token = (SecurityEnv.from_env() if security is None else security).token
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Blocking mode with kernel time limits (SO_RCVTIMEO/SO_SNDTIMEO) rather than Python's
        # socket timeouts, which poll() before every recv: one system call (and one release
        # of the GIL) less per answer. A send that cannot leave in this long means the
        # lighthouse stopped reading: the session breaks.
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))
        self._recv_timeout = 0.0
        self._reader = FrameReader(MAX_EVENT_BYTES)
        self._send_lock = threading.Lock()
        # The condition's lock, taken directly where nobody waits or is woken (a plain lock's
        # context manager is C; the condition's is a Python call).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._slots: dict[int, _Slot] = {}
        self._reading = False  # a caller is reading the connection
        self._followers = 0  # callers waiting for the reader to hand over
        self._broken: SessionBroken | None = None
        self._ids = itertools.count(1)
        hello = spb.SessionRequest(
            hello=spb.Hello(
                replica_id=label,
                protocol=methods.SESSION_PROTOCOL,
                detached=True,
                token=token or "",
            )
        )
        welcome = self._call(0, hello.SerializeToString(), time.monotonic() + timeout_s)
        if isinstance(welcome, Refused):
            self.close()
            raise SessionBroken(f"the lighthouse refused the session: {welcome.message}")

    @property
    def broken(self) -> bool:
        """Whether the connection is gone (the session cannot be used any more)."""
        return self._broken is not None

    def close(self) -> None:
        """Hang up (the lighthouse withdraws this session's pending requests)."""
        self._fail(SessionBroken("the session was closed"))

    def next_id(self) -> int:
        """A fresh request id (request and heartbeat ack ids share one counter)."""
        # A C iterator: each next() is atomic under the GIL, no lock needed.
        return next(self._ids)

    def call(self, request_id: int, request: bytes, timeout_s: float) -> bytes | Refused:
        """Send ``request`` (a serialized ``SessionRequest`` using ``request_id``) and wait for
        its answer: the serialized ``SessionEvent``, or :class:`Refused`.

        Raises:
            TimeoutError: no answer within ``timeout_s`` (the caller stops waiting; a late
                answer is dropped).
            SessionBroken: the connection broke.
        """
        return self._call(request_id, request, time.monotonic() + timeout_s)

    # ------------------------------------------------------------------------------------------

    def _call(self, request_id: int, request: bytes, deadline: float) -> bytes | Refused:
        slot = _Slot()
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._slots[request_id] = slot
            # Nobody reads the connection (the usual case: one caller at a time): this caller
            # takes the reader's turn now, without a hand-over.
            reading = not self._reading
            self._reading = True
        try:
            try:
                with self._send_lock:
                    self._sock.sendall(frame(request))
            except OSError as e:
                self._fail(SessionBroken(f"sending to the lighthouse failed: {e}"))
            while not slot.done:
                if reading:
                    self._read_until(slot, deadline)
                else:
                    reading = self._await_turn(slot, deadline)
        finally:
            with self._lock:
                self._slots.pop(request_id, None)
                if reading:
                    self._reading = False
                    if self._followers:
                        self._cond.notify_all()  # one of them reads next
        answer = slot.answer
        if isinstance(answer, SessionBroken):
            raise answer
        assert answer is not None
        return answer

    def _await_turn(self, slot: _Slot, deadline: float) -> bool:
        """Wait while another caller reads; True once it is this caller's turn to read (its
        answer has not come), False once its answer came.

        Raises:
            TimeoutError: the deadline passed first.
        """
        with self._cond:
            self._followers += 1
            try:
                while not slot.done and self._reading:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    self._cond.wait(remaining)
            finally:
                self._followers -= 1
            if slot.done:
                return False
            self._reading = True
            return True

    def _read_until(self, slot: _Slot, deadline: float) -> None:
        sock = self._sock
        while not slot.done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not remaining / 2 <= self._recv_timeout <= remaining * 1.01 + 0.001:
                # Wake up at the deadline. A limit set for an earlier call is kept while it is
                # neither much earlier (we would just read again) nor more than 1% later.
                self._recv_timeout = remaining
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(remaining))
            try:
                data = sock.recv(_RECV_BYTES)
            except (BlockingIOError, TimeoutError):
                continue  # the kernel's limit passed: the deadline check above decides
            except OSError as e:
                self._fail(SessionBroken(f"reading from the lighthouse failed: {e}"))
                return
            if not data:
                self._fail(SessionBroken("the lighthouse closed the session"))
                return
            try:
                events = self._reader.feed(data)
            except FrameError as e:
                self._fail(SessionBroken(f"the lighthouse sent a bad frame: {e}"))
                return
            for event in events:
                self._dispatch(event, slot)

    def _dispatch(self, event: bytes, mine: _Slot) -> None:
        ack = heartbeat_ack(event)
        if ack is not None:
            self._settle(ack, event, mine)
            return
        issued = issued_quorum(event)
        if issued is not None:
            self._settle(issued[0], event, mine)
            return
        try:
            parsed = spb.SessionEvent.FromString(event)
        except DecodeError as e:
            self._fail(SessionBroken(f"the lighthouse sent an event that does not parse: {e}"))
            return
        kind = parsed.WhichOneof("kind")
        if kind == "quorum":
            self._settle(parsed.quorum.request_id, event, mine)
        elif kind == "heartbeat_ack":
            self._settle(parsed.heartbeat_ack.ack, event, mine)
        elif kind == "welcome":
            self._settle(0, event, mine)
        elif kind == "failed":
            code = _STATUS_BY_VALUE.get(parsed.failed.code, grpc.StatusCode.UNKNOWN)
            self._settle(parsed.failed.request_id, Refused(code, parsed.failed.message), mine)
        elif kind == "closed":
            code = _STATUS_BY_VALUE.get(parsed.closed.code, grpc.StatusCode.UNKNOWN)
            self._fail(
                SessionBroken(
                    f"the lighthouse ended the session: {code.name}: {parsed.closed.message}"
                )
            )
        # Anything else (a notice, a newer kind) is not for a detached session: ignored.

    def _settle(self, request_id: int, answer: bytes | Refused, mine: _Slot) -> None:
        slot = self._slots.get(request_id)
        if slot is mine:
            # The reader's own answer: nobody else waits on it, so no lock and no wake-up.
            if not slot.done:
                slot.answer = answer
                slot.done = True
            return
        with self._cond:
            slot = self._slots.get(request_id)
            if slot is None or slot.done:
                return  # an answer to a call that gave up
            slot.answer = answer
            slot.done = True
            self._cond.notify_all()

    def _fail(self, error: SessionBroken) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = error
            for slot in self._slots.values():
                if not slot.done:
                    slot.answer = self._broken
                    slot.done = True
            self._cond.notify_all()
        try:
            # shutdown first: it wakes a reader blocked in recv on another thread (close alone
            # would leave it blocked).
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
