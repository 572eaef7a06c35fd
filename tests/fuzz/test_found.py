"""One test per bug the fuzzers found, each written (and seen failing) before its fix.

The fuzzers (``tests/fuzz/test_*_fuzz.py``, ``bench/fuzz.py``) look for inputs that crash a
server, get an unclear answer, or change state although they were refused; what they found is
pinned here with the smallest input that showed it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import zlib
from datetime import timedelta
from typing import Any

import grpc
import pytest
import torch
import torch.distributed as dist

from tests.coordination_io.helpers import Background, loopback, raw_call
from tests.dashboard.helpers import lighthouse_with_dashboard
from tests.fuzz import h2call
from tests.fuzz.checkpoint_inputs import frame, split
from tests.fuzz.grpc_inputs import GrpcInput, RawH2
from tests.fuzz.grpc_targets import BOUND_S
from tests.fuzz.http_inputs import read_response
from tests.fuzz.stream_targets import OVERSIZE_WATCH, WatchTarget
from tests.reference import import_reference
from torchheal._wire import methods
from torchheal._wire import session_pb2 as pb_session
from torchheal._wire import torchft_pb2 as pb
from torchheal.checkpointing import CheckpointError, HTTPTransport
from torchheal.checkpointing.pg_transport import (
    _TAG_DATA,
    _TAG_DESCRIPTION,
    _TAG_LENGTH,
    PGTransport,
)
from torchheal.checkpointing.serialization import decode_bytes, encode_bytes, stage
from torchheal.coordination import LighthouseClient, LighthouseServer, ManagerServer
from torchheal.coordination.convert import data_from_wire
from torchheal.coordination.lighthouse.session import MAX_REPLICA_ID_BYTES
from torchheal.coordination.types import QuorumAsk
from torchheal.parameter_server import ParameterServer
from torchheal.process_group.dummy import ProcessGroupDummy

T = timedelta(seconds=10)
DEEP_JSON = "[" * 100_000  # json.loads raises RecursionError, not a ValueError, on this


@pytest.fixture
def lighthouse():
    server = LighthouseServer("127.0.0.1:0", min_replicas=1)
    yield server
    server.shutdown()


@pytest.fixture
def manager(lighthouse):
    server = ManagerServer(
        replica_id="rep:fuzz",
        lighthouse_addr=loopback(lighthouse),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="store:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    yield server
    server.shutdown()


def test_deeply_nested_member_data_is_echoed_not_an_internal_error(lighthouse):
    # Found by the Quorum fuzzer: INTERNAL "maximum recursion depth exceeded" from the
    # lighthouse's conversion of the opaque ``data`` field.
    with pytest.raises(ValueError, match="not valid JSON"):
        data_from_wire(DEEP_JSON)
    request = pb.LighthouseQuorumRequest(
        requester=pb.QuorumMember(replica_id="deep", step=1, data=DEEP_JSON)
    )
    code, payload = raw_call(
        loopback(lighthouse), methods.LIGHTHOUSE_QUORUM.path, request.SerializeToString()
    )
    assert code == grpc.StatusCode.OK, payload
    (echoed,) = pb.LighthouseQuorumResponse.FromString(payload).quorum.participants
    assert echoed.data == DEEP_JSON
    # A client receiving that quorum (another group) reads it too, with data=None.
    quorum = LighthouseClient(loopback(lighthouse), T).quorum("deep", timeout=T, data=None)
    assert [m.replica_id for m in quorum.participants] == ["deep"]


@pytest.fixture
def unary_manager():
    """A manager whose lighthouse is the reference's: it asks for quorums with unary calls."""
    ref = import_reference()
    lighthouse = ref.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = lighthouse.address().rsplit(":", 1)[1]
    server = ManagerServer(
        replica_id="rep:fuzz",
        lighthouse_addr=f"http://127.0.0.1:{port}",
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="store:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
    )
    yield server
    server.shutdown()
    lighthouse.shutdown()


@pytest.mark.parametrize("grpc_timeout", ["99999999H", "9999999H", "99999999M"])
def test_absurdly_long_grpc_timeout_still_runs_the_quorum(unary_manager, grpc_timeout):
    # Found by the raw HTTP/2 fuzzer: a deadline beyond ~7e9 s (valid on the wire: 8 digits and
    # a unit) made the manager's own unary lighthouse call expire at once ("DeadlineExceeded"),
    # because the gRPC client overflows computing its deadline. (With a torchheal lighthouse
    # the request travels on the session stream, which has no such deadline.)
    manager = unary_manager
    request = pb.ManagerQuorumRequest(group_rank=0, step=3, checkpoint_metadata="m")
    headers = [
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", grpc_timeout),
    ]
    result = h2call.raw_call(
        ("127.0.0.1", manager.port()),
        methods.MANAGER_QUORUM.path,
        headers,
        h2call.frame(request.SerializeToString()),
    )
    assert (result.grpc_status, result.grpc_message) == (0, "")
    answer = pb.ManagerQuorumResponse.FromString(result.body[5:])
    assert answer.max_step == 3 and answer.replica_ids == ["rep:fuzz"]
    # Group rank 0 calls in-process; 10**5 days (8.6e9 s) is past the gRPC client's limit.
    in_process = manager.quorum_in_process(
        QuorumAsk(0, 4, "m", False, False, 0, timedelta(days=10**5))
    )
    assert in_process.max_step == 4


def test_should_commit_refuses_a_negative_step_like_quorum_does(manager):
    # Found by the ShouldCommit fuzzer: a vote for step -5 was accepted (and settled), while a
    # quorum request for a negative step is refused as impossible.
    request = pb.ShouldCommitRequest(group_rank=0, step=-5, should_commit=True)
    code, details = raw_call(
        loopback(manager), methods.MANAGER_SHOULD_COMMIT.path, request.SerializeToString()
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "step must be >= 0, got -5"
    # Nothing was settled: the first real vote, for step 0, commits.
    assert manager.should_commit_in_process(0, 0, True, T) is True


def _http(port: int, request: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock, method=request.split(b" ", 1)[0].decode())
        response.begin()
        return response.status, response.read()


@pytest.mark.parametrize(
    ("request_", "status", "message"),
    [
        # Found by the dashboard fuzzer: each of these was a 500 "Server got itself in trouble".
        (b"GET /static/%00 HTTP/1.1\r\nHost: x\r\n\r\n", 404, b"not installed"),
        (b"GET /static/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 404, b"not installed"),
        (
            b"POST /api/replicas/a/kill HTTP/1.1\r\nHost: x\r\nOrigin: http://[\r\n"
            b"Authorization: Bearer tok\r\nContent-Length: 0\r\n\r\n",
            403,
            b"cross-origin",
        ),
        (
            b"POST /api/replicas/a/kill HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer \xff\xfe\r\nContent-Length: 0\r\n\r\n",
            401,
            b"wrong job token",
        ),
    ],
    ids=["nul-in-asset", "long-asset-name", "unparsable-origin", "non-utf8-token"],
)
def test_dashboard_answers_hostile_requests_with_a_client_error(request_, status, message):
    calls: list[Any] = []
    dashboard = {"token": "tok", "kill": lambda address, msg: calls.append(address)}
    with lighthouse_with_dashboard(dashboard=dashboard) as (lh, dash, _):
        LighthouseClient(loopback(lh), T).quorum("a", timeout=T, address="http://127.0.0.1:1")
        got_status, body = _http(dash.port, request_)
        assert (got_status, message in body) == (status, True), body
        assert calls == []


def test_decode_into_template_leaves_it_untouched_when_a_later_block_is_corrupt():
    # In-place receive wrote each block into the template before checking it, so a corrupt
    # block after the first left the template half overwritten.
    sent = {"w": torch.arange(4096, dtype=torch.float32)}  # 16 KiB: 4 blocks of 4 KiB
    data = bytearray(encode_bytes(sent, step=1, block_bytes=4096))
    data[-10] ^= 0xFF  # in the last block
    template = {"w": torch.full((4096,), -1.0)}
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode_bytes(bytes(data), template)
    assert torch.equal(template["w"], torch.full((4096,), -1.0))


def _gloo_pair() -> tuple[Any, Any, Any]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=T)
    groups: list[Any] = [None, None]

    def make(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=T)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("found", client), rank, 2, T)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return groups[0], groups[1], store


def test_pg_receive_into_template_never_writes_unverified_bytes():
    # PGTransport received large storages straight into the template's tensors, so a
    # corrupted transfer left the live model holding the corrupt bytes.
    sender, receiver, _store = _gloo_pair()
    big = torch.randn(300_000)  # > 1 MiB: its own message, received in place
    staged = stage({"w": big}, 1, block_bytes=1 << 16)
    corrupt = staged.buffers[0].clone()
    corrupt[-1] ^= 1

    def send() -> None:
        desc = torch.frombuffer(bytearray(staged.description), dtype=torch.uint8)
        head = torch.tensor([len(staged.description), zlib.crc32(staged.description)])
        for tensor, tag in ((head, _TAG_LENGTH), (desc, _TAG_DESCRIPTION), (corrupt, _TAG_DATA)):
            sender.send([tensor], 1, tag).wait(T)

    template = {"w": torch.zeros(300_000)}
    job = Background(send)
    transport: PGTransport = PGTransport(receiver, T, "cpu", state_dict=lambda: template)
    with pytest.raises(CheckpointError, match="checksum mismatch in storage 0"):
        transport.recv_checkpoint(0, "<n/a>", 1, T)
    job.join()
    assert torch.count_nonzero(template["w"]) == 0


def _raw_http(port: int, request: bytes, half_close: bool = False) -> tuple[int | None, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return read_response(sock, head_only=request.startswith(b"HEAD "))


@pytest.fixture
def checkpoint_server():
    transport = HTTPTransport(timeout=T, num_chunks=0, token="tok", hostname="127.0.0.1")
    transport.send_checkpoint([1], 5, {"w": torch.ones(3)})
    yield transport._server.server_port
    transport.shutdown()


@pytest.fixture
def parameter_server():
    class Server(ParameterServer):
        @classmethod
        def new_process_group(cls):
            return ProcessGroupDummy()

        def forward(self, session_id, pg):
            pass

    server = Server(port=0, hostname="127.0.0.1", token="tok")
    yield server._server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize("method", [b"HEAD", b"POST", b"PUT", b"OPTIONS", b"TRACE", b"CONNECT"])
def test_checkpoint_server_refuses_other_methods_with_405(checkpoint_server, method):
    # Found by the HTTP fuzzer: 501 "Unsupported method" (a server error) for standard methods.
    status, body = _raw_http(checkpoint_server, method + b" /checkpoint/5/full HTTP/1.1\r\n\r\n")
    assert status == 405
    assert body == (b"" if method == b"HEAD" else b"method " + method + b" not allowed: use GET")


@pytest.mark.parametrize("method", [b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT"])
def test_parameter_server_refuses_other_methods_with_400(parameter_server, method):
    # Found by the HTTP fuzzer: 501 "Unsupported method" for the methods it did not list.
    status, body = _raw_http(parameter_server, method + b" /new_session HTTP/1.1\r\n\r\n")
    assert status == 400
    expected = b"unsupported method " + method + b": use GET /new_session\n"
    assert body == (b"" if method == b"HEAD" else expected)


def test_checkpoint_server_answers_a_broken_request_line_with_a_status_line(checkpoint_server):
    # Found by the HTTP fuzzer: the error came back as a bare HTML page without a status line
    # (the handler treated a request without a version as HTTP/0.9).
    status, body = _raw_http(checkpoint_server, b"\x99\xd9garbage", half_close=True)
    assert status == 400 and b"Bad request syntax" in body


@pytest.mark.parametrize("device", ["not a device", "cuda:x", ""])
def test_description_with_an_unknown_device_is_a_checkpoint_error(device):
    # Found by the receiver fuzzer: torch.device()'s RuntimeError escaped the decoder, so a
    # receiving transport raised a plain RuntimeError instead of CheckpointError.
    stream = encode_bytes({"device": torch.device("cpu")}, step=1)
    _, description, data = split(stream)
    spoiled = description.replace(b'"v":"cpu"', json.dumps({"v": device})[1:-1].encode())
    with pytest.raises(CheckpointError, match="invalid checkpoint tree node of kind 'device'"):
        decode_bytes(frame(spoiled, data))


@pytest.mark.parametrize("method", ["Heartbeat", "Quorum"])
def test_lighthouse_refuses_a_replica_id_longer_than_a_session_may_use(lighthouse, method):
    # Found by the Quorum fuzzer (the run grew to 3.8 GB): the unary Heartbeat and Quorum took
    # replica ids up to gRPC's 4 MiB and kept each for a minute, so 200 heartbeats (a second of
    # traffic) made the lighthouse hold ~850 MB; the session's hello already refuses > 1 KiB.
    long_id = "x" * (MAX_REPLICA_ID_BYTES + 1)
    if method == "Heartbeat":
        path = methods.LIGHTHOUSE_HEARTBEAT.path
        request = pb.LighthouseHeartbeatRequest(replica_id=long_id)
    else:
        path = methods.LIGHTHOUSE_QUORUM.path
        request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id=long_id))
    code, details = raw_call(loopback(lighthouse), path, request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.endswith(f"replica_id is longer than {MAX_REPLICA_ID_BYTES} bytes")
    assert lighthouse.status()["heartbeats"] == {}
    # The longest allowed id is fine.
    LighthouseClient(loopback(lighthouse), T).heartbeat("y" * MAX_REPLICA_ID_BYTES)


def _watch_input(payload: bytes, raw: bool) -> GrpcInput:
    if not raw:
        return GrpcInput("late", payload, BOUND_S)
    headers = (("content-type", "application/grpc"), ("te", "trailers"))
    return GrpcInput("raw late", payload, None, RawH2(headers, h2call.frame(payload), True))


@pytest.mark.parametrize("raw", [False, True], ids=["client", "raw"])
@pytest.mark.parametrize(
    ("payload", "kind", "detail"),
    [
        (OVERSIZE_WATCH, "rejected", "RESOURCE_EXHAUSTED: SERVER: Received message larger than"),
        (b"\xff" * 1024, "rejected", "INVALID_ARGUMENT: cannot parse WatchRequest"),
        (pb_session.WatchRequest(group_rank=1).SerializeToString(), "accepted", "watching"),
    ],
    ids=["over-4MiB-valid-rank", "garbage", "valid"],
)
def test_watch_fuzzer_tells_a_late_answer_from_an_open_stream(raw, payload, kind, detail):
    # Found as the Watch fuzzer's 14 "unclear" inputs (10,007 sent): its client gave up after
    # 50 ms plus 50 ns a byte and took "no answer yet" for "watching". The server answered
    # every one of them: a request over gRPC's 4 MiB limit with RESOURCE_EXHAUSTED once it had
    # arrived (0.1-0.8 s on loopback), 1 KiB of garbage with INVALID_ARGUMENT (2 ms, more when
    # the machine was loaded). Over-limit requests with a valid rank were even counted as
    # accepted. A server slowed down on purpose (its loop held 0.5 s, as a loaded machine
    # would) must still get each answer classified for what it was.
    target = WatchTarget()
    try:

        async def hold_the_loop() -> None:
            time.sleep(0.5)  # a busy server, not synchronisation: every answer comes late

        target.server._server.submit(hold_the_loop())
        outcome = target.send(_watch_input(payload, raw))
        assert (outcome.kind, outcome.detail[: len(detail)]) == (kind, detail), outcome
        assert target.watching() == 0  # the server dropped the watch when the client left
        assert target.normal() is None
    finally:
        target.close()
