"""The places the reference's Manager tests reach into, at the reference's paths (issue 43).

The reference's tests patch ``torchft.manager.ManagerClient`` and answer through the client's
``_quorum``, ``_checkpoint_metadata`` and ``should_commit``; they build a group rank 1 whose
rank 0 is not torchheal's, in an environment patched with an int ``MASTER_PORT``.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from unittest.mock import create_autospec, patch

import pytest
import torch
import torch.distributed as dist

import torchheal.manager
from torchheal._base.launch_env import TorchrunEnv
from torchheal._base.security import SecurityEnv
from torchheal.coordination.clients.manager_client import ManagerClient
from torchheal.coordination.types import QuorumAsk, QuorumResult
from torchheal.manager.endpoints import (
    MANAGER_ADDR_KEY,
    REPLICA_ID_KEY,
    client_class,
    metadata_through,
    open_endpoints,
)
from torchheal.work import _ManagedWork

ASK = QuorumAsk(1, 7, "meta", False, True, 0, timedelta(seconds=5))


def _open_rank_1(store: dist.TCPStore):
    return open_endpoints(
        group_rank=1,
        group_world_size=2,
        store_host="localhost",
        store_port=store.port,
        lighthouse_addr=None,
        replica_name=None,
        port=0,
        hostname="localhost",
        heartbeat_interval=timedelta(seconds=1),
        connect_timeout=timedelta(seconds=5),
        quorum_retries=0,
        security=SecurityEnv(),
    )


@pytest.fixture
def reference_rank_0_store():
    """A group store as a reference rank 0 leaves it: address and id, no torchheal mode key."""
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    store.set(MANAGER_ADDR_KEY, "dummy")
    store.set(REPLICA_ID_KEY, "dummy_id")
    return store


def test_package_exports_the_reference_names() -> None:
    assert torchheal.manager.ManagerClient is ManagerClient
    assert torchheal.manager._ManagedWork is _ManagedWork
    assert client_class() is ManagerClient


def test_patched_client_is_built_and_spoken_to_with_reference_methods(
    reference_rank_0_store: dist.TCPStore,
) -> None:
    with patch("torchheal.manager.ManagerClient", autospec=True) as client_mock:
        endpoints = _open_rank_1(reference_rank_0_store)
        assert client_mock.call_count == 1
        # The class mock called with no arguments, as the reference's tests do to reach it.
        assert client_mock() is endpoints.client
        assert endpoints.reference_client
        # No torchheal rank 0 wrote the mode: the group runs as the reference's would.
        assert not endpoints.session_mode and not endpoints.joined_running

        answer = QuorumResult(quorum_id=3)
        endpoints.client._quorum.return_value = answer
        assert endpoints.quorum(ASK) is answer
        endpoints.client._quorum.assert_called_once_with(
            group_rank=1,
            step=7,
            checkpoint_metadata="meta",
            shrink_only=False,
            init_sync=True,
            commit_failures=0,
            timeout=timedelta(seconds=5),
        )

        endpoints.client.should_commit.return_value = False
        assert endpoints.vote(1, 7, True, timedelta(seconds=5)) == (False, False)
        endpoints.client.should_commit.assert_called_once_with(
            1, 7, True, timeout=timedelta(seconds=5)
        )
        endpoints.client.vote.assert_not_called()

        fetch = metadata_through(client_class(), timedelta(seconds=5))
        endpoints.client._checkpoint_metadata.return_value = "http://src/checkpoint/"
        assert fetch("src:1", 1, timedelta(seconds=3)) == "http://src/checkpoint/"
        endpoints.client._checkpoint_metadata.assert_called_once_with(
            1, timeout=timedelta(seconds=3)
        )
        client_mock.assert_called_with("src:1", connect_timeout=timedelta(seconds=5))
        endpoints.close()


def test_own_client_keeps_the_salvage_vote(reference_rank_0_store: dist.TCPStore) -> None:
    # The real class, stood in for by an autospec of it built by the test (not via the package).
    client = create_autospec(ManagerClient, instance=True)
    client.vote.return_value = (False, True)
    with patch("torchheal.manager.endpoints.ManagerClient", return_value=client) as cls:
        # Unpatched in the package, so the endpoints use torchheal's own API.
        with patch("torchheal.manager.ManagerClient", cls):
            endpoints = _open_rank_1(reference_rank_0_store)
    assert not endpoints.reference_client
    assert endpoints.vote(1, 7, True, timedelta(seconds=5)) == (False, True)
    client.vote.assert_called_once_with(1, 7, True, False, timedelta(seconds=5))
    client.should_commit.assert_not_called()


def test_int_master_port_in_a_patched_environment() -> None:
    env = TorchrunEnv.from_env({"MASTER_ADDR": "h", "MASTER_PORT": 29500, "RANK": "1"})
    assert env.require("master_port", "store_port") == 29500
    assert env.require("rank", "rank") == 1


class _Failing(dist.Work):
    """A work whose wait fails while its future never completes."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise RuntimeError("Connection closed by peer")

    def get_future(self) -> torch.futures.Future[object]:
        return torch.futures.Future()


class _Extended:
    """A manager with torchheal's extensions, whose ``wrap_future`` a test replaces."""

    def __init__(self) -> None:
        self.reported: list[Exception] = []
        self.failed: list[Exception] = []

    def wrap_future(self, fut, default, timeout=None):  # pragma: no cover - replaced
        raise AssertionError("the class's wrap_future must not be used")

    def wrap_future_then(self, *args, **kwargs):  # pragma: no cover - must not be used
        raise AssertionError("fusing would skip the replaced wrap_future")

    def fail_step(self, e: Exception, how: str) -> None:  # pragma: no cover - must not be used
        self.failed.append(e)

    def report_error(self, e: Exception) -> None:
        self.reported.append(e)


def test_replaced_wrap_future_makes_the_manager_a_plain_sink() -> None:
    manager = _Extended()
    manager.wrap_future = lambda fut, default, timeout=None: fut
    tensor = torch.ones(2)
    fut = _ManagedWork(manager, _Failing(), tensor, step=manager).as_future()
    # Waited in place (the future never completes): done, with the default, error reported.
    assert fut.done() and fut.value() is tensor
    assert [str(e) for e in manager.reported] == ["Connection closed by peer"]
    assert manager.failed == []


class _NoTorchFuture(dist.Work):
    """A stand-in work whose ``get_future`` is not a torch future (a mocked process group's)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        return True

    def get_future(self) -> object:
        return object()


def test_a_work_without_a_torch_future_completes_when_waited() -> None:
    sink = SimpleNamespace(reported=[])
    sink.report_error = sink.reported.append
    sink.wrap_future = lambda fut, default, timeout=None: fut
    tensor = torch.ones(2)
    work = _NoTorchFuture()
    managed = _ManagedWork(sink, work, tensor)
    seen: list[object] = []
    managed.get_future().then(lambda f: seen.append(f.value()))
    assert managed.wait() is True
    assert seen == [tensor] and sink.reported == []
    assert work.waits >= 1
