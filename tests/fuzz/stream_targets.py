"""torchheal's streaming RPCs under fuzzing: the lighthouse's ``Session`` and the manager's ``Watch``.

* ``torchheal.LighthouseSession/Session`` (a stream each way): each input is a session of one
  to four messages (a valid hello, heartbeat, quorum request or goodbye, hostile values in any
  of them, or malformed bytes) after which the client ends its side. The lighthouse must end a
  broken session with a status naming the problem, answer a bad quorum request with a
  ``QuorumFailed`` event, and keep serving; every event must parse.
* ``torchheal.ManagerNotices/Watch`` (one request, a stream of notices): a valid group rank
  opens a stream that stays open (the client leaves after 50 ms); anything else is refused.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import grpc
from hypothesis import strategies as st

from tests.fuzz.grpc_inputs import corpus, malformed, well_formed
from tests.fuzz.grpc_targets import (
    CLEAR,
    STATE_CHECKED,
    TRANSPORT_INTERNAL,
    T,
    _lighthouse_state,
    _thread_gone,
    manager_state,
)
from tests.fuzz.http_targets import wait_for
from tests.fuzz.runner import ACCEPTED, REJECTED, UNCLEAR, Outcome
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseServer, ManagerServer

# How long a client keeps a stream that the server leaves open.
OPEN_S = 0.05


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


class WatchTarget:
    """``torchheal.ManagerNotices/Watch`` of a manager server (world size 2)."""

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
        self._strategy = payloads.map(lambda p: p[1])

    def inputs(self) -> st.SearchStrategy[bytes]:
        return self._strategy

    def known(self) -> list[bytes]:
        return [payload for _, payload in corpus(spb.WatchRequest)]

    def send(self, value: bytes) -> Outcome:
        # Long enough for a large request to arrive and be refused (gRPC's limit is 4 MiB).
        result = _run(self._call(value, timeout=OPEN_S + len(value) / 20e6))
        what = f"{result.code.name}: {result.details}"
        try:
            rank = spb.WatchRequest.FromString(value).group_rank
        except Exception:
            rank = None
        if result.code == grpc.StatusCode.DEADLINE_EXCEEDED and not result.events:
            if rank is None or not 0 <= rank < 2:
                return Outcome(UNCLEAR, f"watching although group_rank is {rank}")
            return Outcome(ACCEPTED, "watching (stream open)")
        if not result.details:
            return Outcome(UNCLEAR, f"{result.code.name} without a message")
        if result.code in CLEAR:
            return Outcome(REJECTED, what, result.code in STATE_CHECKED)
        return Outcome(UNCLEAR, what)

    def snapshot(self) -> Any:
        return manager_state(self.server)

    def alive(self) -> str | None:
        return _thread_gone(self.server, "manager server")

    def normal(self) -> str | None:
        result = _run(
            self._call(spb.WatchRequest(group_rank=1).SerializeToString(), timeout=OPEN_S)
        )
        if result.code != grpc.StatusCode.DEADLINE_EXCEEDED or result.events:
            return f"{result.code.name}: {result.details} ({len(result.events)} events)"
        return None

    def close(self) -> None:
        self._channel.close()
        self.server.shutdown()
        self.lighthouse.shutdown()


def all_targets() -> dict[str, Any]:
    """Constructors of the streaming targets, by table name."""
    return {SessionTarget.name: SessionTarget, WatchTarget.name: WatchTarget}
