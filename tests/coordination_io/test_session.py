"""torchheal sessions between manager servers and the lighthouse (issue 9).

Real servers on loopback. A replica group that dies is a real process killed with SIGKILL (its
connection ends because the kernel closes it), a frozen one a real process stopped with SIGSTOP.
The heartbeat timeout is set far beyond each test's deadlines wherever the point is that the
lighthouse learns of a death from the session's end, not from the heartbeats: with only
heartbeats (the reference's way), those tests could not finish.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from datetime import timedelta

import grpc
import pytest

from tests.coordination_io.helpers import Background, loopback, raw_call, wait_until
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseServer, ManagerServer
from torchheal.coordination.clients.manager_client import ManagerClient
from torchheal.coordination.types import Notice, NoticeKind, QuorumAsk

LONG = timedelta(seconds=30)

# A manager server in its own process, which the test can SIGKILL or SIGSTOP: it prints its
# port, then takes part in quorum rounds whenever the test writes a line with a step.
_MEMBER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    from torchheal.coordination import ManagerServer
    from torchheal.coordination.types import QuorumAsk
    server = ManagerServer(
        replica_id=sys.argv[2], lighthouse_addr=sys.argv[1], hostname="127.0.0.1",
        bind="127.0.0.1:0", store_addr="store:1", world_size=1,
        heartbeat_interval=timedelta(milliseconds=100), connect_timeout=timedelta(seconds=10),
    )
    print(server.port(), server.session_mode, flush=True)
    for line in sys.stdin:
        ask = QuorumAsk(0, int(line), "", False, False, 0, timedelta(seconds=30))
        result = server.quorum_in_process(ask)
        print("quorum", result.quorum_id, result.replica_world_size, flush=True)
    """
)


class Member:
    """A replica group's manager server in a child process."""

    def __init__(self, lighthouse: str, replica_id: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _MEMBER, lighthouse, replica_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        port, session_mode = self.proc.stdout.readline().split()
        self.port = int(port)
        self.session_mode = session_mode == "True"

    def ask(self, step: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()

    def answer(self) -> tuple[int, int]:
        assert self.proc.stdout is not None
        _, quorum_id, size = self.proc.stdout.readline().split()
        return int(quorum_id), int(size)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def members() -> Iterator[Callable[[str, str], Member]]:
    started: list[Member] = []

    def start(lighthouse: str, replica_id: str) -> Member:
        member = Member(lighthouse, replica_id)
        started.append(member)
        return member

    yield start
    for member in started:
        member.end()


def _ask(group_rank: int, step: int, timeout: timedelta) -> QuorumAsk:
    return QuorumAsk(group_rank, step, "", False, False, 0, timeout)


def _quorum(server: ManagerServer, step: int) -> Background:
    return Background(lambda: server.quorum_in_process(_ask(0, step, LONG)))


def test_torchheal_servers_open_sessions_and_form_quorums(make_lighthouse, make_manager):
    lighthouse = make_lighthouse()
    a = make_manager(loopback(lighthouse), replica_id="a:1")
    b = make_manager(loopback(lighthouse), replica_id="b:1")
    assert a.session_mode and b.session_mode
    ra, rb = _quorum(a, 3), _quorum(b, 3)
    qa, qb = ra.join(), rb.join()
    assert (qa.quorum_id, qa.replica_world_size, qb.replica_rank) == (1, 2, 1)
    assert list(qa.replica_ids) == ["a:1", "b:1"]


def test_a_killed_group_is_gone_at_once_and_its_peers_are_told(
    make_lighthouse, make_manager, members
):
    # 2 groups: with heartbeats alone the survivor could not go on for 60 s (1 of 2 is no
    # majority while the dead group still counts as healthy).
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    survivor = make_manager(loopback(lighthouse), replica_id="a:1")
    notices: queue.Queue = queue.Queue()
    survivor.add_lost_listener(notices.put)
    victim = members(loopback(lighthouse), "b:1")
    assert victim.session_mode

    pending = _quorum(survivor, 5)
    victim.ask(5)
    assert pending.join().replica_world_size == 2
    assert victim.answer() == (1, 2)

    victim.proc.kill()
    assert notices.get(timeout=20) == Notice(NoticeKind.LOST, "b:1", 1, "connection ended")
    alone = _quorum(survivor, 6).join()
    assert (alone.quorum_id, alone.replica_world_size) == (2, 1)


def test_a_frozen_group_is_lost_when_its_heartbeat_expires(make_lighthouse, make_manager, members):
    lighthouse = make_lighthouse(heartbeat_timeout_ms=1000)
    survivor = make_manager(loopback(lighthouse), replica_id="a:1")
    notices: queue.Queue = queue.Queue()
    survivor.add_lost_listener(notices.put)
    frozen = members(loopback(lighthouse), "b:1")
    pending = _quorum(survivor, 5)
    frozen.ask(5)
    pending.join()
    frozen.answer()

    frozen.proc.send_signal(signal.SIGSTOP)
    # Its session stays open (the kernel keeps the connection); its heartbeats stop.
    assert notices.get(timeout=20) == Notice(NoticeKind.LOST, "b:1", 1, "heartbeat expired")
    assert _quorum(survivor, 6).join().replica_world_size == 1
    frozen.proc.send_signal(signal.SIGCONT)


def test_a_group_that_shuts_down_says_goodbye(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    a = make_manager(loopback(lighthouse), replica_id="a:1")
    b = make_manager(loopback(lighthouse), replica_id="b:1")
    notices: queue.Queue = queue.Queue()
    a.add_lost_listener(notices.put)
    ra, rb = _quorum(a, 1), _quorum(b, 1)
    ra.join(), rb.join()
    b.shutdown()
    assert notices.get(timeout=20) == Notice(NoticeKind.LOST, "b:1", 1, "left: shutdown")
    assert _quorum(a, 2).join().replica_world_size == 1


def test_ranks_watching_their_server_hear_the_notice(make_lighthouse, make_manager, members):
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    server = make_manager(loopback(lighthouse), replica_id="a:1", world_size=2)
    with grpc.insecure_channel(loopback(server)) as channel:
        watch = channel.unary_stream(
            methods.MANAGER_WATCH.path,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=spb.Notice.FromString,
        )(spb.WatchRequest(group_rank=1), timeout=60)
        victim = members(loopback(lighthouse), "b:1")
        rank0 = _quorum(server, 4)
        rank1 = Background(lambda: server.quorum_in_process(_ask(1, 4, LONG)))
        victim.ask(4)
        rank0.join(), rank1.join()
        victim.proc.kill()
        notice = next(watch)
        assert (notice.lost.replica_id, notice.lost.quorum_id) == ("b:1", 1)
        watch.cancel()

        bad = channel.unary_stream(
            methods.MANAGER_WATCH.path,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=spb.Notice.FromString,
        )(spb.WatchRequest(group_rank=7), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "group_rank 7 is outside [0, 2)" in info.value.details()


# ---------------------------------------------------------------------------------------------
# The protocol, spoken by hand


def _session(lighthouse: LighthouseServer, *requests: spb.SessionRequest | bytes):
    """Open a raw session, send ``requests``, return (events received, final status)."""
    channel = grpc.insecure_channel(loopback(lighthouse))
    call = channel.stream_stream(methods.LIGHTHOUSE_SESSION.path)

    def raw() -> Iterator[bytes]:
        for r in requests:
            yield r if isinstance(r, bytes) else r.SerializeToString()

    events = []
    try:
        for event in call(raw(), timeout=10):
            events.append(spb.SessionEvent.FromString(event))
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    channel.close()
    return events, code, details


def _hello(replica_id: str = "x:1") -> spb.SessionRequest:
    return spb.SessionRequest(hello=spb.Hello(replica_id=replica_id, protocol=1))


def _request(replica_id: str, request_id: int = 1, timeout_ms: int = 5000) -> spb.SessionRequest:
    return spb.SessionRequest(
        quorum=spb.QuorumRequest(
            request_id=request_id,
            requester=pb.QuorumMember(replica_id=replica_id, step=1),
            timeout_ms=timeout_ms,
        )
    )


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([b"\xff\xff\xff"], "cannot parse SessionRequest"),
        ([spb.SessionRequest(heartbeat=spb.Heartbeat())], "must start with hello"),
        ([_hello(), _hello()], "hello sent twice"),
        (
            [
                _hello(""),
            ],
            "replica_id is empty",
        ),
        ([_hello("r" * 2000)], "longer than 1024 bytes"),
        (
            [spb.SessionRequest(hello=spb.Hello(replica_id="x", protocol=0))],
            "protocol must be >= 1",
        ),
        ([_hello(), spb.SessionRequest()], "empty SessionRequest"),
    ],
)
def test_a_stream_that_breaks_the_protocol_is_ended(make_lighthouse, requests, message):
    lighthouse = make_lighthouse()
    _, code, details = _session(lighthouse, *requests)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in details
    # The lighthouse goes on serving.
    ok, _ = raw_call(
        loopback(lighthouse),
        methods.LIGHTHOUSE_HEARTBEAT.path,
        pb.LighthouseHeartbeatRequest(replica_id="probe").SerializeToString(),
    )
    assert ok == grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_request("someone-else:1"), "a session speaks for its own group only"),
        (_request("x:1", timeout_ms=0), "timeout_ms must be > 0"),
        (
            spb.SessionRequest(quorum=spb.QuorumRequest(request_id=9, timeout_ms=10)),
            "missing requester",
        ),
        (
            spb.SessionRequest(
                quorum=spb.QuorumRequest(
                    request_id=9,
                    requester=pb.QuorumMember(replica_id="x:1", step=-4),
                    timeout_ms=10,
                )
            ),
            "requester.step must be >= 0",
        ),
    ],
)
def test_a_bad_quorum_request_is_refused_and_the_session_goes_on(
    make_lighthouse, request_, message
):
    lighthouse = make_lighthouse()
    goodbye = spb.SessionRequest(goodbye=spb.Goodbye(reason="done"))
    events, code, _ = _session(lighthouse, _hello(), request_, _request("x:1", 2), goodbye)
    kinds = [e.WhichOneof("kind") for e in events]
    assert kinds[0] == "welcome"
    assert code == grpc.StatusCode.OK
    failed = [e.failed for e in events if e.WhichOneof("kind") == "failed"]
    assert len(failed) == 1 and message in failed[0].message
    assert failed[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_request_that_times_out_is_withdrawn(make_lighthouse):
    # min_replicas=2: a lone request can never complete; after its timeout it must not stay
    # registered (a later group would otherwise form a quorum with a requester nobody awaits).
    lighthouse = make_lighthouse(min_replicas=2)
    channel = grpc.insecure_channel(loopback(lighthouse))
    call = channel.stream_stream(methods.LIGHTHOUSE_SESSION.path)
    outbox: queue.Queue = queue.Queue()
    stream = call(iter(outbox.get, None), timeout=30)
    outbox.put(_hello().SerializeToString())
    assert spb.SessionEvent.FromString(next(stream)).WhichOneof("kind") == "welcome"
    outbox.put(_request("x:1", 5, timeout_ms=200).SerializeToString())
    failed = spb.SessionEvent.FromString(next(stream)).failed
    assert (failed.request_id, failed.code) == (5, grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    wait_until(lambda: lighthouse.status()["waiting"] == [], what="the request withdrawn")
    outbox.put(None)
    channel.close()


def test_a_newer_session_of_the_same_group_survives_the_old_ones_end(make_lighthouse):
    # x reconnects (a new stream) before its old one ends; when the old one does end, the group
    # is not lost: the only notice y hears is the newer session's goodbye.
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    channel = grpc.insecure_channel(loopback(lighthouse))
    call = channel.stream_stream(methods.LIGHTHOUSE_SESSION.path)

    def open_session(replica_id: str):
        box: queue.Queue = queue.Queue()
        stream = call(iter(box.get, None), timeout=60)
        box.put(_hello(replica_id).SerializeToString())
        assert spb.SessionEvent.FromString(next(stream)).WhichOneof("kind") == "welcome"
        return box, stream

    x_old_box, x_old = open_session("x:1")
    y_box, y = open_session("y:1")
    x_old_box.put(_request("x:1", 1).SerializeToString())
    y_box.put(_request("y:1", 1).SerializeToString())
    assert spb.SessionEvent.FromString(next(x_old)).quorum.quorum.quorum_id == 1
    assert spb.SessionEvent.FromString(next(y)).quorum.quorum.quorum_id == 1

    x_new_box, _ = open_session("x:1")
    x_old.cancel()
    x_new_box.put(spb.SessionRequest(goodbye=spb.Goodbye(reason="done")).SerializeToString())
    lost = spb.SessionEvent.FromString(next(y)).lost
    assert (lost.replica_id, lost.quorum_id, lost.reason) == ("x:1", 1, "left: done")
    y_box.put(None)
    channel.close()


@pytest.mark.parametrize("lane", ["direct", "stream", "unreachable"])
def test_sessions_travel_on_the_direct_lane_else_the_grpc_stream(
    make_lighthouse, make_manager, members, lane
):
    # The lighthouse's direct TCP lane when it has one that answers; its gRPC stream when it
    # has none or the lane cannot be reached. A killed group is gone at once either way.
    lighthouse = make_lighthouse(
        heartbeat_timeout_ms=60_000, direct_port=None if lane == "stream" else 0
    )
    if lane == "unreachable":
        # It still announces the lane's port, but nothing answers there any more.
        lighthouse._server.submit(lighthouse._stop_lane()).result()
    survivor = make_manager(loopback(lighthouse), replica_id="a:1")
    assert survivor.session_mode and survivor._link.direct == (lane == "direct")
    notices: queue.Queue = queue.Queue()
    survivor.add_lost_listener(notices.put)
    victim = members(loopback(lighthouse), "b:1")
    pending = _quorum(survivor, 5)
    victim.ask(5)
    assert pending.join().replica_world_size == 2
    victim.proc.kill()
    assert notices.get(timeout=20) == Notice(NoticeKind.LOST, "b:1", 1, "connection ended")
    assert _quorum(survivor, 6).join().replica_world_size == 1


def _in_quorum_1(
    lighthouse: LighthouseServer, make_manager: Callable[..., ManagerServer], names: str
) -> tuple[dict[str, ManagerServer], dict[str, queue.Queue]]:
    """A manager server per name (``"{name}:1"``), each with a queue of the notices it hears,
    all in quorum 1."""
    servers = {rid: make_manager(loopback(lighthouse), replica_id=f"{rid}:1") for rid in names}
    heard: dict[str, queue.Queue] = {rid: queue.Queue() for rid in servers}
    for rid, server in servers.items():
        server.add_lost_listener(heard[rid].put)
    first = [_quorum(server, 5) for server in servers.values()]
    assert {r.join().quorum_id for r in first} == {1}
    return servers, heard


def test_a_live_group_left_out_of_a_newer_quorum_is_told_and_no_one_else(
    make_lighthouse, make_manager
):
    # c stays at work in quorum 1 (a long step, a build waiting on a peer that gave it up)
    # while a and b go on: once the lighthouse issues quorum 2 without it, it must hear that
    # quorum 1 is over, or it waits there for its own timeout. Its heartbeats never expire.
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    servers, heard = _in_quorum_1(lighthouse, make_manager, "abc")
    assert servers["c"]._doubt() is None

    ra, rb = _quorum(servers["a"], 6), _quorum(servers["b"], 6)
    assert (ra.join().quorum_id, rb.join().replica_world_size) == (2, 2)
    notice = heard["c"].get(timeout=20)
    assert (notice.kind, notice.replica_id, notice.quorum_id) == (NoticeKind.SUPERSEDED, "c:1", 1)
    assert notice.reason.startswith("not in quorum 2")
    # Only a build of quorum 1 is abandoned: its vote is not doubted (it commits such a step
    # as its peers did, as before the notice).
    assert servers["c"]._doubt() is None
    # The notice went to c alone: a and b are not told about a group that is alive.
    assert heard["a"].empty() and heard["b"].empty()

    # c asks again and is let back in. (Its
    # request must be in before a's and b's: theirs alone would complete quorum 2 again.)
    rc = _quorum(servers["c"], 6)
    wait_until(lambda: lighthouse.status()["waiting"] == ["c:1"], what="c's request")
    ra, rb = _quorum(servers["a"], 7), _quorum(servers["b"], 7)
    assert {r.join().quorum_id for r in (ra, rb, rc)} == {3}
    assert servers["c"]._doubt() is None
    assert heard["a"].empty() and heard["b"].empty()


def test_a_group_that_gives_up_a_build_is_announced_without_a_doubt_of_its_vote(
    make_lighthouse, make_manager
):
    # b's build of quorum 1 failed on its own (not for a lost peer): a, which waits in that
    # build for b's address, must hear of it now, not at its own timeout. b is alive (no
    # session ends, no heartbeat expires). b hears it too (its other ranks may wait in a
    # collective of quorum 1), without a doubt of its vote: the rank that gave up votes no.
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    servers, heard = _in_quorum_1(lighthouse, make_manager, "ab")

    servers["b"].report_gave_up(7, "not the latest quorum: ignored")
    servers["b"].report_gave_up(1, "ConnectionResetError: the store went away")
    reason = "gave up building its process group: ConnectionResetError: the store went away"
    assert heard["a"].get(timeout=20) == Notice(NoticeKind.LOST, "b:1", 1, reason, gave_up=True)
    assert heard["b"].get(timeout=20) == Notice(NoticeKind.GAVE_UP, "b:1", 1, reason, gave_up=True)
    assert servers["b"]._doubt() is None
    # Both ask again and train on together.
    ra, rb = _quorum(servers["a"], 5), _quorum(servers["b"], 5)
    assert ra.join().replica_world_size == rb.join().replica_world_size == 2
    assert heard["a"].empty() and heard["b"].empty()


def test_a_rank_other_than_0_reports_a_build_it_gave_up_through_its_server(
    make_lighthouse, make_manager
):
    lighthouse = make_lighthouse(heartbeat_timeout_ms=60_000)
    a = make_manager(loopback(lighthouse), replica_id="a:1")
    b = make_manager(loopback(lighthouse), replica_id="b:1", world_size=2)
    notices: queue.Queue = queue.Queue()
    a.add_lost_listener(notices.put)
    ra = _quorum(a, 3)
    rb = [Background(lambda r=r: b.quorum_in_process(_ask(r, 3, LONG))) for r in (0, 1)]
    assert ra.join().quorum_id == 1 and {r.join().quorum_id for r in rb} == {1}

    client = ManagerClient(loopback(b), timedelta(seconds=10))
    try:
        with pytest.raises(RuntimeError, match="quorum_id must be > 0"):
            client.gave_up(0, "bad", timedelta(seconds=10))
        client.gave_up(1, "RuntimeError: rank 1's own failure", timedelta(seconds=10))
    finally:
        client.close()
    assert notices.get(timeout=20) == Notice(
        NoticeKind.LOST,
        "b:1",
        1,
        "gave up building its process group: RuntimeError: rank 1's own failure",
        gave_up=True,
    )
