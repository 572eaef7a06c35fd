"""The manager server over real gRPC, against a real lighthouse (or a scripted one)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import grpc
import pytest

from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import ManagerClient, ManagerServer
from torchheal.coordination.rpc.errors import RPCError, StatusError
from torchheal.coordination.rpc.server import AioServerThread, unary_handler

from .helpers import Background, loopback, raw_call, wait_until

T = timedelta(seconds=10)


def mclient(server: ManagerServer) -> ManagerClient:
    return ManagerClient(server.address(), connect_timeout=timedelta(seconds=5))


def quorum(c: ManagerClient, rank: int, step: int = 0, **kwargs) -> Background:
    args = dict(
        group_rank=rank,
        step=step,
        checkpoint_metadata=f"meta{rank}",
        shrink_only=False,
        init_sync=True,
        commit_failures=0,
        timeout=T,
    )
    args.update(kwargs)
    return Background(lambda: c._quorum(**args))


def test_address_and_heartbeats(make_lighthouse, make_manager):
    lighthouse = make_lighthouse()
    manager = make_manager(loopback(lighthouse), replica_id="hb:xyz")
    assert manager.address() == f"http://127.0.0.1:{manager.port()}"
    wait_until(lambda: "hb:xyz" in lighthouse.status()["heartbeats"], what="a heartbeat")


def test_get_quorum_single_group(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse), store_addr="store_addr:1", world_size=1)
    result = quorum(mclient(manager), 0, step=123, commit_failures=3).join()
    assert result.quorum_id == 1
    assert result.replica_rank == 0
    assert result.replica_world_size == 1
    assert result.store_address == "store_addr:1"
    assert result.max_step == 123
    assert result.max_replica_rank == 0
    assert result.max_world_size == 1
    assert result.heal is False
    assert result.commit_failures == 3


def test_all_ranks_of_a_group_share_one_lighthouse_round(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse), world_size=3)
    c = mclient(manager)
    calls = [quorum(c, rank, step=4) for rank in range(3)]
    results = [call.join() for call in calls]
    assert {r.quorum_id for r in results} == {1}
    assert all(r.max_step == 4 for r in results)
    # Each rank's metadata is kept for healers.
    assert c._checkpoint_metadata(2, T) == "meta2"


def test_second_group_heals_on_first_step_with_init_sync(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=2)
    managers = [make_manager(loopback(lighthouse), replica_id=f"rep_{i}") for i in range(2)]
    calls = [quorum(mclient(m), 0, step=0, init_sync=True) for m in managers]
    first, second = (call.join() for call in calls)
    assert first.quorum_id == second.quorum_id == 1
    assert first.heal is False and first.recover_dst_replica_ranks == [1]
    assert second.heal is True and second.recover_src_replica_rank == 0
    assert second.recover_src_manager_address == managers[0].address()


def test_checkpoint_metadata_rank_not_found(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse))
    c = mclient(manager)
    with pytest.raises(RuntimeError, match="rank not found") as info:
        c._checkpoint_metadata(0, T)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    quorum(c, 0, checkpoint_metadata="the metadata").join()
    assert c._checkpoint_metadata(0, T) == "the metadata"


def test_should_commit_barrier(make_lighthouse, make_manager):
    lighthouse = make_lighthouse()
    manager = make_manager(loopback(lighthouse), world_size=2)
    c = mclient(manager)
    votes = [Background(lambda r=r: c.should_commit(r, 1, True, T)) for r in range(2)]
    assert [v.join() for v in votes] == [True, True]
    votes = [Background(lambda r=r: c.should_commit(r, 2, r == 0, T)) for r in range(2)]
    assert [v.join() for v in votes] == [False, False]


def test_vote_for_another_step_is_rejected(make_lighthouse, make_manager):
    lighthouse = make_lighthouse()
    manager = make_manager(loopback(lighthouse), world_size=2)
    c = mclient(manager)
    decided = [Background(lambda r=r: c.should_commit(r, 7, True, T)) for r in range(2)]
    assert [v.join() for v in decided] == [True, True]
    waiting = Background(lambda: c.should_commit(0, 8, True, T))
    # Whether or not rank 0's vote for step 8 is in yet, a vote for step 6 is stale.
    with pytest.raises(RPCError, match="voted for step 6") as info:
        c.should_commit(1, 6, True, T)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert c.should_commit(1, 8, True, T) is True
    assert waiting.join() is True


def test_quorum_without_deadline_is_invalid_argument(make_lighthouse, make_manager):
    lighthouse = make_lighthouse()
    manager = make_manager(loopback(lighthouse))
    request = pb.ManagerQuorumRequest(group_rank=0, step=1).SerializeToString()
    code, details = raw_call(loopback(manager), methods.MANAGER_QUORUM.path, request, timeout=None)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "missing timeout"


def test_quorum_timeout_is_timeout_error(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=2)
    manager = make_manager(loopback(lighthouse))
    with pytest.raises(TimeoutError, match=r"status: Cancelled, message.*Timeout expired"):
        quorum(mclient(manager), 0, timeout=timedelta(milliseconds=10)).join()


def test_cancelled_rank_does_not_complete_or_break_a_round(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse), world_size=2)
    c = mclient(manager)
    short = timedelta(milliseconds=200)
    with pytest.raises(TimeoutError):
        quorum(c, 0, timeout=short).join()
    # Rank 0 gave up, so rank 1 alone must not start a round with rank 0's stale request.
    with pytest.raises(TimeoutError):
        quorum(c, 1, timeout=short).join()
    assert lighthouse.status()["quorum_id"] == 0
    results = [call.join() for call in (quorum(c, 0, step=2), quorum(c, 1, step=2))]
    assert [r.quorum_id for r in results] == [1, 1]


def test_connect_timeout_when_no_lighthouse():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="failed to connect"):
        ManagerServer(
            replica_id="x",
            lighthouse_addr=f"http://127.0.0.1:{port}",
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr="s:1",
            world_size=1,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=timedelta(milliseconds=300),
        )


class ScriptedLighthouse:
    """A stand-in lighthouse (the dependency, not the server under test) that fails N times."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

        async def quorum_rpc(request, context):
            self.calls += 1
            if self.calls <= self.failures:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, "scripted outage")
            return pb.LighthouseQuorumResponse(
                quorum=pb.Quorum(quorum_id=9, participants=[request.requester])
            )

        async def heartbeat_rpc(request, context):
            await asyncio.sleep(0)
            return pb.LighthouseHeartbeatResponse()

        self.server = AioServerThread(
            "scripted-lighthouse",
            "127.0.0.1:0",
            {
                methods.LIGHTHOUSE_SERVICE: {
                    "Quorum": unary_handler(methods.LIGHTHOUSE_QUORUM, quorum_rpc),
                    "Heartbeat": unary_handler(methods.LIGHTHOUSE_HEARTBEAT, heartbeat_rpc),
                }
            },
            security=SecurityEnv(),
        )

    def port(self) -> int:
        return self.server.port


@pytest.fixture
def scripted():
    servers = []

    def make(failures: int) -> ScriptedLighthouse:
        servers.append(ScriptedLighthouse(failures))
        return servers[-1]

    yield make
    for s in servers:
        s.server.shutdown()


def test_quorum_retries_recover_from_a_lighthouse_failure(scripted, make_manager):
    lighthouse = scripted(failures=1)
    manager = make_manager(loopback(lighthouse), quorum_retries=1)
    result = quorum(mclient(manager), 0, timeout=timedelta(seconds=2)).join()
    assert result.quorum_id == 9
    assert lighthouse.calls == 2


def test_lighthouse_failure_reaches_every_waiting_rank_at_once(scripted, make_manager):
    lighthouse = scripted(failures=100)
    manager = make_manager(loopback(lighthouse), world_size=2, quorum_retries=0)
    c = mclient(manager)
    # Deadlines far beyond the join below: a rank that only fails at its deadline fails the test.
    calls = [quorum(c, r, timeout=timedelta(seconds=120)) for r in range(2)]
    for call in calls:
        with pytest.raises(RPCError, match="lighthouse quorum failed after 0 retries") as info:
            call.join(timeout=20)
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert "scripted outage" in str(info.value)
    # The next round works once the lighthouse does.
    lighthouse.failures = 0
    results = [call.join() for call in [quorum(c, r) for r in range(2)]]
    assert [r.quorum_id for r in results] == [9, 9]


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    from datetime import timedelta
    from torchheal.coordination import ManagerServer
    server = ManagerServer("victim:1", sys.argv[1], "127.0.0.1", "127.0.0.1:0", "s:1", 1,
                           timedelta(milliseconds=100), timedelta(seconds=10))
    print(server.address(), flush=True)
    threading.Event().wait(60)
    sys.exit(3)
    """
)


def test_kill_exits_the_process_with_code_1(make_lighthouse, caplog):
    lighthouse = make_lighthouse()
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, f"http://{loopback(lighthouse)}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("http://127.0.0.1:"), proc.stderr.read()
        mclient_ = ManagerClient(address, connect_timeout=timedelta(seconds=10))
        mclient_.kill("killed from test")
        assert proc.wait(timeout=20) == 1
        assert "killed from test" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
