"""The client's end of a session (``coordination/session_client.py``): events in, decisions out.

No sockets and no clock: each test feeds serialized events and times to one ``SessionClient`` and
reads what it decided. Waiters are plain strings (a shell's would be futures or slots).
"""

from __future__ import annotations

import grpc
import pytest

from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.session_client import (
    Answer,
    Ended,
    Lost,
    Refused,
    SessionClient,
    Welcomed,
)


def event(**kind: object) -> bytes:
    return spb.SessionEvent(**kind).SerializeToString()


def welcome(protocol: int = 2, quorum_id: int = 0, heartbeat_timeout_ms: int = 0) -> bytes:
    return event(
        welcome=spb.Welcome(
            protocol=protocol, quorum_id=quorum_id, heartbeat_timeout_ms=heartbeat_timeout_ms
        )
    )


def issued(request_id: int, quorum_id: int, *members: str) -> bytes:
    quorum = pb.Quorum(
        quorum_id=quorum_id, participants=[pb.QuorumMember(replica_id=m) for m in members]
    )
    return event(quorum=spb.QuorumIssued(request_id=request_id, quorum=quorum))


def failed(request_id: int, code: int, message: str) -> bytes:
    return event(failed=spb.QuorumFailed(request_id=request_id, code=code, message=message))


def request(session: SessionClient, waiter: str) -> int:
    request_id, _ = session.quorum_request(pb.QuorumMember(replica_id="g:1"), 1.0, waiter)
    return request_id


def sent(data: bytes) -> spb.SessionRequest:
    return spb.SessionRequest.FromString(data)


# ----------------------------------------------------------------------------------------------
# Hello and welcome


def test_the_hello_names_the_group_its_protocol_and_the_last_quorum_it_had() -> None:
    session = SessionClient("g:1", last_quorum_id=7)
    hello = sent(session.hello(0.0)).hello
    assert (hello.replica_id, hello.protocol, hello.detached) == ("g:1", 2, False)
    assert hello.protocol == methods.SESSION_PROTOCOL
    assert hello.last_quorum.quorum_id == 7 and hello.token == ""
    assert not sent(SessionClient("g:1").hello(0.0)).hello.HasField("last_quorum")
    detached = sent(SessionClient("client:x", detached=True).hello(0.0, "tok")).hello
    assert detached.detached and detached.token == "tok"


def test_a_welcome_says_the_protocol_whether_the_job_ran_and_the_heartbeat_timeout() -> None:
    session = SessionClient("g:1")
    said = session.receive(welcome(protocol=2, quorum_id=4, heartbeat_timeout_ms=3000), 1.0)
    assert isinstance(said, Welcomed) and said.waiter is None and said.welcome.quorum_id == 4
    assert (session.protocol, session.joined_running, session.heartbeat_timeout_s) == (2, True, 3)
    # A later welcome (a reopened session, another lighthouse): the protocol is the newest one,
    # whether the job ran is the first welcome's, and a timeout not said keeps the last said.
    session.receive(welcome(protocol=1, quorum_id=0, heartbeat_timeout_ms=0), 2.0)
    assert (session.protocol, session.joined_running, session.heartbeat_timeout_s) == (1, True, 3)


def test_a_first_welcome_with_no_quorum_yet_means_a_fresh_job() -> None:
    session = SessionClient("g:1")
    assert session.joined_running is None
    session.receive(welcome(quorum_id=0))
    assert session.joined_running is False


def test_a_detached_hello_is_request_0_and_its_welcome_or_refusal_settles_it() -> None:
    session = SessionClient("client", detached=True)
    session.expect(0, "hello")
    said = session.receive(welcome())
    assert isinstance(said, Welcomed) and said.waiter == "hello"
    session.expect(0, "again")
    assert session.receive(failed(0, 16, "bad token")) == Answer(
        "again", Refused(grpc.StatusCode.UNAUTHENTICATED, "bad token")
    )


# ----------------------------------------------------------------------------------------------
# Answers and refusals


def test_an_answer_settles_its_own_request_once_and_records_the_quorum() -> None:
    session = SessionClient("g:1")
    first, second = request(session, "a"), request(session, "b")
    said = session.receive(issued(second, 5, "g:1", "g:2"))
    assert isinstance(said, Answer) and said.waiter == "b"
    assert said.value.quorum_id == 5 and [m.replica_id for m in said.value.participants] == [
        "g:1",
        "g:2",
    ]
    assert session.last_quorum is not None and session.last_quorum.quorum_id == 5
    assert session.receive(issued(second, 5, "g:1")) is None  # answered already
    # An older quorum answers its request but is not what the next hello tells.
    said = session.receive(issued(first, 3, "g:1"))
    assert isinstance(said, Answer) and said.waiter == "a" and said.value.quorum_id == 3
    assert session.last_quorum.quorum_id == 5
    assert sent(session.hello(0.0)).hello.last_quorum.quorum_id == 5


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (4, grpc.StatusCode.DEADLINE_EXCEEDED),
        (3, grpc.StatusCode.INVALID_ARGUMENT),
        (999, grpc.StatusCode.UNKNOWN),  # a code this client does not know
    ],
)
def test_a_refusal_settles_its_request_with_the_status(code: int, status: object) -> None:
    session = SessionClient("g:1")
    request_id = request(session, "a")
    other = request(session, "b")
    assert session.receive(failed(request_id, code, "no")) == Answer("a", Refused(status, "no"))
    assert session.receive(failed(request_id, code, "no")) is None
    said = session.receive(issued(other, 1, "g:1"))
    assert isinstance(said, Answer) and said.waiter == "b"


def test_a_withdrawn_request_drops_its_late_answer() -> None:
    session = SessionClient("g:1")
    request_id = request(session, "a")
    session.withdraw(request_id)
    assert session.receive(issued(request_id, 1, "g:1")) is None
    assert session.last_quorum is None  # nobody took that quorum


def test_a_detached_session_hands_back_the_event_bytes_in_any_order() -> None:
    session = SessionClient("client", detached=True)
    ids = [session.next_id() for _ in range(3)]
    for request_id, waiter in zip(ids, "xyz", strict=True):
        session.expect(request_id, waiter)
    ack = event(heartbeat_ack=spb.HeartbeatAck(ack=ids[2]))
    assert session.receive(ack) == Answer("z", ack)  # the last asked, answered first
    quorum = issued(ids[0], 9, "g:1")
    assert session.receive(quorum) == Answer("x", quorum)
    assert session.last_quorum is None  # speaks for no group: nothing to tell a lighthouse
    assert session.receive(ack) is None


def test_request_and_ack_ids_come_from_one_counter() -> None:
    session = SessionClient("g:1", silent_s=4.0)
    first = request(session, "a")
    beat = sent(session.heartbeat(5.0)).heartbeat
    second = request(session, "b")
    assert len({first, beat.ack, second}) == 3 and 0 not in {first, beat.ack, second}


# ----------------------------------------------------------------------------------------------
# Heartbeats and silence


@pytest.mark.parametrize(
    ("now", "asks_ack", "silent"),
    [
        (10.0, False, None),  # just heard
        (10.9, False, None),
        (11.0, True, None),  # quiet for a quarter of the limit: ask for a sign of life
        (13.9, True, None),
        (14.0, True, 4.0),  # silent for the limit: the session counts as broken
        (20.0, True, 10.0),
    ],
)
def test_silence_is_judged_from_the_last_event(
    now: float, asks_ack: bool, silent: float | None
) -> None:
    session = SessionClient("g:1", silent_s=4.0)
    session.hello(0.0)
    session.receive(welcome(), 10.0)
    assert session.silence(now) == silent
    beat = sent(session.heartbeat(now)).heartbeat
    assert beat.replica_id == "" and (beat.ack != 0) == asks_ack


def test_any_event_is_a_sign_of_life_even_an_unexpected_ack() -> None:
    session = SessionClient("g:1", silent_s=4.0)
    session.hello(0.0)
    assert session.silence(4.0) == 4.0  # counted from the hello until the first event
    assert session.receive(event(heartbeat_ack=spb.HeartbeatAck(ack=77)), 3.5) is None
    assert session.silence(7.0) is None and session.silence(7.5) == 4.0


def test_a_silence_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="silent_s"):
        SessionClient("g:1", silent_s=0)


# ----------------------------------------------------------------------------------------------
# The session's end


def test_a_break_fails_every_pending_request_and_keeps_the_first_reason() -> None:
    session = SessionClient("g:1")
    first, second = request(session, "a"), request(session, "b")
    assert sorted(session.end("the lighthouse session broke")) == ["a", "b"]
    assert session.end("again") == []
    assert session.ended == "the lighthouse session broke"
    assert session.receive(issued(first, 1, "g:1")) is None  # failed already
    assert session.receive(failed(second, 4, "late")) is None
    session.hello(1.0)  # a new session (reopened, or on the next lighthouse)
    assert session.ended is None


def test_the_lighthouse_closing_the_session_or_bad_bytes_end_it() -> None:
    session = SessionClient("g:1")
    closed = event(closed=spb.SessionClosed(code=16, message="no job token"))
    assert session.receive(closed) == Ended(
        grpc.StatusCode.UNAUTHENTICATED,
        "no job token",
        "the lighthouse ended the session: UNAUTHENTICATED: no job token",
    )
    said = session.receive(b"\xff\xff\xff")
    assert isinstance(said, Ended) and said.code == grpc.StatusCode.INTERNAL
    assert "does not parse" in said.reason


def test_notices_say_whether_they_are_about_this_group() -> None:
    session = SessionClient("g:1")
    for replica_id, ours in (("g:1", True), ("g:2", False)):
        notice = spb.MemberLost(replica_id=replica_id, quorum_id=3, reason="left")
        assert session.receive(event(lost=notice)) == Lost(notice, ours)
    notice = spb.MemberLost(replica_id="client", quorum_id=3)
    said = SessionClient("client", detached=True).receive(event(lost=notice))
    assert said == Lost(notice, False)  # a detached session speaks for nobody


# ----------------------------------------------------------------------------------------------
# What the group says of its history


def test_requests_carry_the_history_the_group_holds() -> None:
    session = SessionClient("g:1")
    request_id, data = session.quorum_request(pb.QuorumMember(replica_id="g:1"), 2.5, "a")
    quorum = sent(data).quorum
    assert (quorum.request_id, quorum.timeout_ms, quorum.lineage) == (request_id, 2500, 0)
    session.receive(issued(request_id, 6, "g:1", "g:2"))
    session.holds_last_quorum(steps_done=3)  # it committed in quorum 6
    _, data = session.quorum_request(pb.QuorumMember(replica_id="g:1"), 0.0001, "b")
    assert (sent(data).quorum.lineage, sent(data).quorum.timeout_ms) == (6, 1)


def test_a_quorum_known_only_by_its_id_gives_no_history() -> None:
    session = SessionClient("g:1", last_quorum_id=4)  # from an earlier process's store
    session.holds_last_quorum()
    assert session.lineage == 0


def test_the_goodbye_says_the_steps_done_until_the_group_asks_again() -> None:
    session = SessionClient("g:1")
    session.holds_last_quorum(steps_done=12)
    assert sent(session.goodbye("shutdown")).goodbye == spb.Goodbye(
        reason="shutdown", steps_done=12
    )
    session.asked()
    assert sent(session.goodbye("shutdown")).goodbye.steps_done == 0


@pytest.mark.parametrize(("protocol", "sends"), [(0, False), (1, False), (2, True), (3, True)])
def test_a_given_up_build_is_told_only_to_a_lighthouse_that_knows_the_message(
    protocol: int, sends: bool
) -> None:
    session = SessionClient("g:1")
    if protocol:
        session.receive(welcome(protocol=protocol))
    data = session.gave_up(5, "store failed")
    assert (data is not None) == sends
    if data is not None:
        assert sent(data).gave_up == spb.GaveUp(quorum_id=5, reason="store failed")
