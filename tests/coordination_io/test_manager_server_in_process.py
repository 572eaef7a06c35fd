"""Group rank 0's in-process calls to its ManagerServer, side by side with the gRPC path.

The in-process calls (``quorum_in_process``, ``should_commit_in_process``) must be the gRPC
calls minus the round trip: same rounds, same results, same errors, same deadlines.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import timedelta

import grpc
import pytest

from torchheal.coordination import ManagerClient, ManagerServer
from torchheal.coordination.rpc.errors import RPCError
from torchheal.coordination.types import QuorumAsk

from .helpers import Background, loopback, wait_until
from .test_manager_server import ScriptedLighthouse

T = timedelta(seconds=10)


def mclient(server: ManagerServer) -> ManagerClient:
    return ManagerClient(server.address(), connect_timeout=timedelta(seconds=5))


def quorum_ask(rank: int, step: int = 0, **kwargs) -> QuorumAsk:
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
    return QuorumAsk(**args)


def local_quorum(server: ManagerServer, rank: int, **kwargs) -> Background:
    return Background(lambda: server.quorum_in_process(quorum_ask(rank, **kwargs)))


def reference_args(ask: QuorumAsk) -> dict:
    """``ask`` as the reference's ``_quorum`` keywords (it has no ``data``: group rank 0's)."""
    args = asdict(ask)
    del args["data"]
    return args


def grpc_quorum(client: ManagerClient, rank: int, **kwargs) -> Background:
    return Background(lambda: client._quorum(**reference_args(quorum_ask(rank, **kwargs))))


@pytest.fixture
def scripted():
    servers = []

    def make(failures: int) -> ScriptedLighthouse:
        servers.append(ScriptedLighthouse(failures))
        return servers[-1]

    yield make
    for s in servers:
        s.server.shutdown()


def test_in_process_and_grpc_ranks_share_one_round_and_see_the_same_result(
    make_lighthouse, make_manager
):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse), world_size=2, store_addr="store:7")
    c = mclient(manager)
    calls = [local_quorum(manager, 0, step=5, commit_failures=2), grpc_quorum(c, 1, step=5)]
    local, remote = (call.join() for call in calls)
    assert lighthouse.status()["quorum_id"] == 1
    # One group: every group rank's view is the same, whichever way it asked.
    assert local == remote
    assert local.quorum_id == 1 and local.max_step == 5 and local.store_address == "store:7"
    # replica_ids travels (field 13) on both paths.
    assert local.replica_ids == ["rep:uuid"]
    assert c._checkpoint_metadata(0, T) == "meta0"


def test_in_process_quorum_timeout_is_the_grpc_timeout_error(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=2)
    manager = make_manager(loopback(lighthouse))
    pattern = r"^ManagerService/Quorum to .* failed: status: Cancelled, message.*Timeout expired"
    with pytest.raises(TimeoutError, match=pattern):
        local_quorum(manager, 0, timeout=timedelta(milliseconds=10)).join()
    with pytest.raises(TimeoutError, match=pattern):
        grpc_quorum(mclient(manager), 0, timeout=timedelta(milliseconds=10)).join()


def test_in_process_rank_that_times_out_leaves_the_round(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse), world_size=2)
    c = mclient(manager)
    short = timedelta(milliseconds=200)
    with pytest.raises(TimeoutError):
        local_quorum(manager, 0, timeout=short).join()
    # Rank 0 gave up, so rank 1 alone must not start a round with rank 0's stale request.
    with pytest.raises(TimeoutError):
        grpc_quorum(c, 1, timeout=short).join()
    assert lighthouse.status()["quorum_id"] == 0
    results = [call.join() for call in (local_quorum(manager, 0), grpc_quorum(c, 1))]
    assert [r.quorum_id for r in results] == [1, 1]


def test_in_process_rejections_carry_the_grpc_status_and_message(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=1)
    manager = make_manager(loopback(lighthouse), world_size=2)
    c = mclient(manager)
    for ask in (quorum_ask(5), quorum_ask(0, step=-1), quorum_ask(0, commit_failures=-1)):
        with pytest.raises(RPCError) as local:
            manager.quorum_in_process(ask)
        with pytest.raises(RPCError) as remote:
            c._quorum(**reference_args(ask))
        assert local.value.code == remote.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(local.value) == str(remote.value)

    with pytest.raises(RPCError) as local:
        manager.should_commit_in_process(7, 1, True, T)
    with pytest.raises(RPCError) as remote:
        c.should_commit(7, 1, True, T)
    assert local.value.code == remote.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(local.value) == str(remote.value)


def test_in_process_vote_joins_the_grpc_votes(make_lighthouse, make_manager):
    lighthouse = make_lighthouse()
    manager = make_manager(loopback(lighthouse), world_size=2)
    c = mclient(manager)
    votes = [
        Background(lambda: manager.should_commit_in_process(0, 1, True, T)),
        Background(lambda: c.should_commit(1, 1, True, T)),
    ]
    assert [v.join() for v in votes] == [True, True]
    # Rank 1 votes no over gRPC: rank 0's in-process yes does not commit.
    votes = [
        Background(lambda: manager.should_commit_in_process(0, 2, True, T)),
        Background(lambda: c.should_commit(1, 2, False, T)),
    ]
    assert [v.join() for v in votes] == [False, False]
    # A vote for a settled step is stale, on either path, with the same message.
    with pytest.raises(RPCError, match="voted for step 1") as local:
        manager.should_commit_in_process(0, 1, True, T)
    with pytest.raises(RPCError) as remote:
        c.should_commit(0, 1, True, T)
    assert str(local.value) == str(remote.value)


def test_in_process_vote_timeout(make_lighthouse, make_manager):
    lighthouse = make_lighthouse()
    manager = make_manager(loopback(lighthouse), world_size=2)
    with pytest.raises(TimeoutError, match=r"status: Cancelled, message.*Timeout expired"):
        manager.should_commit_in_process(0, 1, True, timedelta(milliseconds=50))
    # The vote was cast before the deadline, as over gRPC: rank 1's vote completes the round.
    assert mclient(manager).should_commit(1, 1, True, T) is True


def test_in_process_lighthouse_failure_is_the_grpc_error(scripted, make_manager):
    lighthouse = scripted(failures=100)
    manager = make_manager(loopback(lighthouse), world_size=1, quorum_retries=0)
    with pytest.raises(RPCError, match="lighthouse quorum failed after 0 retries") as info:
        local_quorum(manager, 0, timeout=timedelta(seconds=120)).join()
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert "scripted outage" in str(info.value)
    lighthouse.failures = 0
    assert local_quorum(manager, 0).join().quorum_id == 9


def test_in_process_call_on_a_shut_down_server_is_a_runtime_error(make_lighthouse, make_manager):
    lighthouse = make_lighthouse(min_replicas=2)
    manager = make_manager(loopback(lighthouse))
    waiting = local_quorum(manager, 0, timeout=timedelta(seconds=120))
    wait_until(lambda: lighthouse.status()["waiting"], what="rank 0 waiting at the lighthouse")
    manager.shutdown()
    # The call in flight ends with the shutdown, long before its deadline.
    with pytest.raises(RPCError) as info:
        waiting.join(timeout=20)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(RuntimeError, match="shut down"):
        manager.should_commit_in_process(0, 1, True, T)


def test_an_in_process_vote_waiting_for_its_group_ends_with_the_server(
    make_lighthouse, make_manager
):
    lighthouse = make_lighthouse()
    manager = make_manager(loopback(lighthouse), world_size=2)
    waiting = Background(
        lambda: manager.should_commit_in_process(0, 1, True, timedelta(seconds=120))
    )
    wait_until(lambda: manager._vote.voted == {0}, what="rank 0's vote cast")
    manager.shutdown()
    # Ends with the shutdown, long before its deadline, as a gRPC vote would.
    with pytest.raises(RPCError) as info:
        waiting.join(timeout=20)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
