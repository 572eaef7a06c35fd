"""A blocking client's session with the lighthouse, on its direct TCP lane.

:class:`DirectSession` is what ``LighthouseClient`` talks through when the lighthouse is
torchheal's: one TCP connection (``lighthouse/tcp.py``) carrying a *detached* session (it speaks
for no group, so closing it declares nobody dead), with requests answered by id.

No thread or event loop of its own: a caller sends its request and reads the connection itself
until its answer arrives, handing other callers' answers over on the way (leader and followers),
so a single caller pays one ``send`` and one ``recv``. A refused request comes back as
:class:`Refused`; a broken connection fails every waiting call with :class:`SessionBroken`. With
TLS on, the lighthouse opens no lane and the client never gets here.
"""

from __future__ import annotations

import math
import socket
import struct
import threading
import time

from torchheal._base.security import SecurityEnv
from torchheal.coordination.rpc.frames import FrameError, FrameReader, frame
from torchheal.coordination.session_client import (
    MAX_EVENT_BYTES,
    Answer,
    Ended,
    Refused,
    SessionClient,
    Welcomed,
    heartbeat_request,
    issued_quorum,
    quorum_request,
)

# Re-exported for lighthouse_client.py, this session's caller.
__all__ = [
    "DirectSession",
    "Refused",
    "SessionBroken",
    "heartbeat_request",
    "issued_quorum",
    "quorum_request",
]

# The most one read takes. Below glibc's mmap threshold (128 KiB): recv() allocates a bytes of
# this size first, and a larger one is an mmap/munmap pair per read (docs/failures.md).
_RECV_BYTES = 64 * 1024


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` for SO_RCVTIMEO/SO_SNDTIMEO (at least 1 ms: 0 would mean forever)."""
    micros = max(1000, math.ceil(seconds * 1e6))
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


class SessionBroken(ConnectionError):
    """The connection to the lighthouse broke (or the lighthouse ended the session)."""


class _Slot:
    """Where one call's answer lands (the session core's waiter)."""

    __slots__ = ("answer", "done")

    def __init__(self) -> None:
        self.done = False
        self.answer: bytes | Refused | SessionBroken | None = None


class DirectSession:
    """A detached session on the lighthouse's direct lane; safe to share between threads.

    The protocol is :class:`~torchheal.coordination.session_client.SessionClient`'s, driven under
    ``_lock``; this class carries its bytes and wakes its callers.

    Args:
        host: the lighthouse's host.
        port: its direct lane's port.
        label: names the session in the lighthouse's logs.
        timeout_s: how long connecting and the lighthouse's welcome may take.
        security: the job token to send.

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
        security: SecurityEnv,
    ) -> None:
        token = security.token
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Kernel time limits (SO_RCVTIMEO/SO_SNDTIMEO) rather than Python's socket timeouts,
        # which poll() before every recv. A send that cannot leave in time breaks the session.
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))
        self._recv_timeout = 0.0
        self._reader = FrameReader(MAX_EVENT_BYTES)
        self._send_lock = threading.Lock()
        # The condition's lock, taken directly where nobody waits or is woken (a plain lock's
        # context manager is C; the condition's is a Python call).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._core: SessionClient[_Slot] = SessionClient(label, detached=True)
        self._reading = False  # a caller is reading the connection
        self._followers = 0  # callers waiting for the reader to hand over
        # The hello is request 0: its welcome (or refusal) settles it.
        welcome = self._call(0, self._core.hello(0.0, token or ""), time.monotonic() + timeout_s)
        if isinstance(welcome, Refused):
            self.close()
            raise SessionBroken(f"the lighthouse refused the session: {welcome.message}")

    @property
    def broken(self) -> bool:
        """Whether the connection is gone (the session cannot be used any more)."""
        return self._core.ended is not None

    def close(self) -> None:
        """Hang up (the lighthouse withdraws this session's pending requests)."""
        self._fail("the session was closed")

    def next_id(self) -> int:
        """A fresh request id (request and heartbeat ack ids share one counter)."""
        return self._core.next_id()

    def call(self, request_id: int, request: bytes, timeout_s: float) -> bytes | Refused:
        """Send ``request`` (a serialized ``SessionRequest`` using ``request_id``) and wait for
        its answer: the serialized ``SessionEvent``, or :class:`Refused`. Raises ``TimeoutError``
        (a late answer is dropped) or :class:`SessionBroken`.
        """
        return self._call(request_id, request, time.monotonic() + timeout_s)

    # ------------------------------------------------------------------------------------------

    def _call(self, request_id: int, request: bytes, deadline: float) -> bytes | Refused:
        slot = _Slot()
        with self._lock:
            if self._core.ended is not None:
                raise SessionBroken(self._core.ended)
            self._core.expect(request_id, slot)
            # Nobody reads the connection (the usual case: one caller at a time): this caller
            # takes the reader's turn now, without a hand-over.
            reading = not self._reading
            self._reading = True
        try:
            try:
                with self._send_lock:
                    self._sock.sendall(frame(request))
            except OSError as e:
                self._fail(f"sending to the lighthouse failed: {e}")
            while not slot.done:
                if reading:
                    self._read_until(slot, deadline)
                else:
                    reading = self._await_turn(slot, deadline)
        finally:
            with self._lock:
                self._core.withdraw(request_id)
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
        """Wait while another caller reads: True once it is this caller's turn to read, False
        once its answer came (``TimeoutError`` at the deadline)."""
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
                self._fail(f"reading from the lighthouse failed: {e}")
                return
            if not data:
                self._fail("the lighthouse closed the session")
                return
            try:
                events = self._reader.feed(data)
            except FrameError as e:
                self._fail(f"the lighthouse sent a bad frame: {e}")
                return
            for event in events:
                with self._lock:
                    decision = self._core.receive(event)
                if isinstance(decision, (Answer, Welcomed)):
                    answer = decision.value if isinstance(decision, Answer) else event
                    self._hand(decision.waiter, answer, slot)
                elif isinstance(decision, Ended):
                    self._fail(decision.reason)
                # Anything else (a notice, a newer kind) is not for a detached session.

    def _hand(self, waiter: _Slot | None, answer: bytes | Refused, mine: _Slot) -> None:
        """Give ``waiter`` its answer (the core hands each waiter over once)."""
        if waiter is mine:
            # The reader's own answer: nobody else waits on it, so no lock and no wake-up.
            mine.answer = answer
            mine.done = True
        elif waiter is not None:
            with self._cond:
                waiter.answer = answer
                waiter.done = True
                self._cond.notify_all()

    def _fail(self, why: str) -> None:
        with self._cond:
            for slot in self._core.end(why):
                slot.answer = SessionBroken(self._core.ended)
                slot.done = True
            self._cond.notify_all()
        try:
            # shutdown first: it wakes a reader blocked in recv on another thread (close alone
            # would leave it blocked).
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
