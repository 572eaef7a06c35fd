"""torchheal's streaming RPCs under fuzzing: the lighthouse's ``Session`` and the manager's ``Watch``.

* ``torchheal.LighthouseSession/Session`` (a stream each way): each input is a session of one
  to four messages (a valid hello, heartbeat, quorum request or goodbye, hostile values in any
  of them, or malformed bytes) after which the client ends its side. The lighthouse must end a
  broken session with a status naming the problem, answer a bad quorum request with a
  ``QuorumFailed`` event, and keep serving; every event must parse.
* ``torchheal.ManagerNotices/Watch`` (one request, a stream of notices): a valid group rank
  opens a stream that stays open (the server registers a watcher; the client then leaves and
  the watcher must go); anything else is refused with a status. Sent through the ``grpc``
  client or as raw HTTP/2.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from tests.fuzz import h2call
from tests.fuzz.grpc_inputs import (
    TIMEOUTS,
    GrpcInput,
    RawH2,
    corpus,
    malformed,
    raw_inputs,
    tag,
    varint,
    well_formed,
)
from tests.fuzz.grpc_targets import (
    BOUND_S,
    CLEAR,
    STATE_CHECKED,
    TRANSPORT_INTERNAL,
    T,
    _code,
    _lighthouse_state,
    _thread_gone,
    classify,
    manager_state,
)
from tests.fuzz.http_targets import wait_for
from tests.fuzz.runner import ACCEPTED, REJECTED, UNCLEAR, Outcome
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseServer, ManagerServer


def _message(**kind: Any) -> bytes:
    return spb.SessionRequest(**kind).SerializeToString()


def session_messages(replica_id: str = "fuzz:session") -> dict[str, bytes]:
    """The messages of an honest session, by kind."""
    member = pb.QuorumMember(replica_id=replica_id, address="http://127.0.0.1:1", step=1)
    return {
        "hello": _message(hello=spb.Hello(replica_id=replica_id, protocol=1)),
        "heartbeat": _message(heartbeat=spb.Heartbeat()),
        "quorum": _message(
            quorum=spb.QuorumRequest(request_id=7, requester=member, timeout_ms=1000)
        ),
        "goodbye": _message(goodbye=spb.Goodbye(reason="done")),
        "gave_up": _message(gave_up=spb.GaveUp(quorum_id=1, reason="fuzz")),
    }


class _StreamOutcome:
    def __init__(self, events: list[bytes], code: grpc.StatusCode, details: str) -> None:
        self.events, self.code, self.details = events, code, details


def _run(call: Any) -> _StreamOutcome:
    events: list[bytes] = []
    try:
        for event in call:
            events.append(event)
    except grpc.RpcError as e:
        return _StreamOutcome(events, e.code(), e.details() or "")
    return _StreamOutcome(events, grpc.StatusCode.OK, "")


class SessionTarget:
    """``torchheal.LighthouseSession/Session`` of a lighthouse (min_replicas=1)."""

    name = "lighthouse Session (stream)"

    def __init__(self) -> None:
        self.server = LighthouseServer("127.0.0.1:0", min_replicas=1, join_timeout_ms=1)
        self._channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port()}")
        self._call = self._channel.stream_stream(methods.LIGHTHOUSE_SESSION.path)
        honest = st.sampled_from(list(session_messages().values()))
        one = st.one_of(
            honest,
            honest,
            well_formed(spb.SessionRequest).map(lambda p: p[1]),
            malformed(spb.SessionRequest).map(lambda p: p[1]),
        )
        # Often an honest hello first, so the rest reaches the session's own checks.
        self._strategy = st.tuples(st.booleans(), st.lists(one, min_size=1, max_size=3)).map(
            lambda v: [session_messages()["hello"], *v[1]] if v[0] else v[1]
        )

    def inputs(self) -> st.SearchStrategy[list[bytes]]:
        return self._strategy

    def known(self) -> list[list[bytes]]:
        """Each known hostile message alone, and those of a quorum request after a hello."""
        hello = session_messages()["hello"]
        known = corpus(spb.SessionRequest)
        return [[payload] for _, payload in known] + [
            [hello, payload] for kind, payload in known if kind.startswith("hostile quorum")
        ]

    def send(self, value: list[bytes]) -> Outcome:
        result = _run(self._call(iter(value), timeout=2.0))
        for event in result.events:
            try:
                spb.SessionEvent.FromString(event)
            except Exception as e:
                return Outcome(UNCLEAR, f"an event that does not parse: {e}")
        what = f"{result.code.name}: {result.details}"
        # Only a session refused at its first message must leave no trace.
        first_refused = len(value) == 1
        if result.code == grpc.StatusCode.OK:
            return Outcome(ACCEPTED, f"ended after {len(result.events)} events")
        if not result.details:
            return Outcome(UNCLEAR, f"{result.code.name} without a message")
        if result.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Outcome(UNCLEAR, f"{what} (the session stayed open after the client ended)")
        if result.code in CLEAR:
            return Outcome(REJECTED, what, first_refused and result.code in STATE_CHECKED)
        if result.code == grpc.StatusCode.INTERNAL and any(
            t in result.details for t in TRANSPORT_INTERNAL
        ):
            return Outcome(REJECTED, what)
        return Outcome(UNCLEAR, what)

    def snapshot(self) -> Any:
        # A session the client ended is closed on the server just after: let it finish, so
        # its clean-up is not taken for the next input's doing.
        wait_for(lambda: not self.server._sessions, "ended sessions to close")
        return _lighthouse_state(self.server)

    def alive(self) -> str | None:
        return _thread_gone(self.server, "lighthouse")

    def normal(self) -> str | None:
        messages = session_messages("normal:session")
        sent = [messages["hello"], messages["quorum"]]

        def requests() -> Any:
            yield from sent
            # Stay until the quorum arrives, then leave.
            done.wait(10)
            yield messages["goodbye"]

        done = threading.Event()
        call = self._call(requests(), timeout=10.0)
        kinds = []
        try:
            for event in call:
                kind = spb.SessionEvent.FromString(event).WhichOneof("kind")
                kinds.append(kind)
                if kind == "quorum":
                    done.set()
        except grpc.RpcError as e:
            done.set()
            return f"{e.code().name}: {e.details()}"
        return None if kinds[:2] == ["welcome", "quorum"] else f"events {kinds}"

    def close(self) -> None:
        self._channel.close()
        self.server.shutdown()


def _poll(predicate: Any, timeout: float) -> bool:
    """Poll ``predicate`` until true or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: an interruptible pause between polls
    while not predicate():
        if time.monotonic() > deadline:
            return False
        pause.wait(h2call.POLL_S)
    return True


# A request just over gRPC's 4 MiB receive limit whose rank is valid: the size must refuse it.
OVERSIZE_WATCH = spb.WatchRequest(group_rank=1).SerializeToString() + (
    tag(9, 2) + varint(4 << 20) + b"\x00" * (4 << 20)
)


class WatchTarget:
    """``torchheal.ManagerNotices/Watch`` of a manager server (world size 2).

    A valid group rank opens a stream the server never ends by itself (notices come only when
    a group of the quorum is lost). "Watching" is therefore read from the server's own state,
    never from the absence of an answer: an input is accepted once the server registered a
    watcher for it (then the client cancels, and the watcher must be dropped), refused once
    the stream ended with a status, and unanswered only if neither happened within
    :data:`BOUND_S`. A short client deadline here once took a refusal that came late (a
    request over the 4 MiB limit takes 0.1-0.8 s to arrive; a loaded machine delays any
    answer past 50 ms) for an open stream.

    Inputs: 4 in 5 through the ``grpc`` client (any deadline of :data:`TIMEOUTS`), 1 in 5 as
    raw HTTP/2 (odd headers and framing, :func:`raw_inputs`).
    """

    name = "manager Watch (stream)"

    def __init__(self) -> None:
        self.lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
        self.server = ManagerServer(
            replica_id="fuzz:watch",
            lighthouse_addr=f"127.0.0.1:{self.lighthouse.port()}",
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr="127.0.0.1:1",
            world_size=2,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=T,
        )
        self._channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port()}")
        self._call = self._channel.unary_stream(methods.MANAGER_WATCH.path)
        payloads = st.one_of(
            well_formed(spb.WatchRequest),
            well_formed(spb.WatchRequest),
            malformed(spb.WatchRequest),
        )
        by_client = st.tuples(payloads, st.sampled_from(TIMEOUTS)).map(
            lambda v: GrpcInput(v[0][0], v[0][1], v[1])
        )
        raw = raw_inputs(payloads)
        self._strategy = st.sampled_from([True] * 4 + [False]).flatmap(
            lambda client: by_client if client else raw
        )

    def inputs(self) -> st.SearchStrategy[GrpcInput]:
        return self._strategy

    def known(self) -> list[GrpcInput]:
        """Every known hostile rank, and a request over the size limit (client and raw)."""
        out = [GrpcInput(kind, payload, BOUND_S) for kind, payload in corpus(spb.WatchRequest)]
        headers = (("content-type", "application/grpc"), ("te", "trailers"))
        raw = RawH2(headers, h2call.frame(OVERSIZE_WATCH), True)
        out.append(GrpcInput("over 4 MiB", OVERSIZE_WATCH, BOUND_S))
        out.append(GrpcInput("raw http/2 (whole): over 4 MiB", OVERSIZE_WATCH, None, raw))
        return out

    def watching(self) -> int:
        """How many watch streams the server has registered (a set's size: read atomically)."""
        return len(self.server._notices._watchers)

    def send(self, value: GrpcInput) -> Outcome:
        try:
            rank: int | None = spb.WatchRequest.FromString(value.payload).group_rank
        except DecodeError:
            rank = None
        outcome = self._send_raw(value) if value.raw is not None else self._send_client(value)
        # However the call ended, the server must drop its watcher (no stream outlives it).
        if not _poll(lambda: self.watching() == 0, BOUND_S):
            return Outcome(UNCLEAR, f"a watcher left registered after the call ended ({outcome})")
        if outcome.kind == ACCEPTED and (rank is None or not 0 <= rank < 2):
            return Outcome(UNCLEAR, f"watching although group_rank is {rank}")
        return outcome

    def _send_client(self, value: GrpcInput) -> Outcome:
        call = self._call(value.payload, timeout=value.timeout)
        _poll(lambda: call.done() or self.watching() > 0, BOUND_S)
        if not call.done():
            call.cancel()
            if self.watching() > 0:
                return Outcome(ACCEPTED, "watching (the server registered the stream)")
            return Outcome(UNCLEAR, f"no answer and no watch registered within {BOUND_S}s")
        result = _run(call)
        return self._classify(value, result.code, result.details, len(result.events))

    def _send_raw(self, value: GrpcInput) -> Outcome:
        assert value.raw is not None
        try:
            result = h2call.raw_call(
                ("127.0.0.1", self.server.port()),
                methods.MANAGER_WATCH.path,
                list(value.raw.headers),
                value.raw.body,
                timeout=BOUND_S,
                open_when=lambda: self.watching() > 0,
            )
        except TimeoutError:
            return Outcome(UNCLEAR, f"no answer and no watch registered within {BOUND_S}s")
        except ConnectionError as e:
            return Outcome(UNCLEAR, f"connection failed: {e}")
        if result.still_open:  # raw_call closed the connection: the server ends the stream
            return Outcome(ACCEPTED, "watching (the server registered the stream)")
        if result.grpc_status is None:
            if not value.raw.compliant:  # not a gRPC request: refused at the HTTP/2 level
                return Outcome(
                    REJECTED, f"refused by the gRPC transport (HTTP {result.http_status})"
                )
            return Outcome(
                UNCLEAR, f"no grpc-status (HTTP {result.http_status}, reset={result.reset})"
            )
        events = 1 if len(result.body) >= 5 else 0  # a framed message is a notice
        return self._classify(value, _code(result.grpc_status), result.grpc_message, events)

    def _classify(
        self, value: GrpcInput, code: grpc.StatusCode, details: str, events: int
    ) -> Outcome:
        if events:
            return Outcome(UNCLEAR, f"{events} notices although no group was lost")
        if code == grpc.StatusCode.OK:
            return Outcome(UNCLEAR, "the server ended a watch with OK")
        return classify(methods.MANAGER_WATCH, value, code, details, b"")

    def snapshot(self) -> Any:
        return manager_state(self.server)

    def alive(self) -> str | None:
        return _thread_gone(self.server, "manager server")

    def normal(self) -> str | None:
        """A rank-1 watch: registered by the server, dropped once the client leaves."""
        call = self._call(spb.WatchRequest(group_rank=1).SerializeToString(), timeout=BOUND_S)
        _poll(lambda: call.done() or self.watching() > 0, BOUND_S)
        if call.done():
            result = _run(call)
            return f"{result.code.name}: {result.details} ({len(result.events)} events)"
        call.cancel()
        if self.watching() == 0:
            return f"no watch registered within {BOUND_S}s"
        if not _poll(lambda: self.watching() == 0, BOUND_S):
            return "the watcher stayed registered after the client left"
        return None

    def close(self) -> None:
        self._channel.close()
        self.server.shutdown()
        self.lighthouse.shutdown()


def all_targets() -> dict[str, Any]:
    """Constructors of the streaming targets, by table name."""
    return {SessionTarget.name: SessionTarget, WatchTarget.name: WatchTarget}
