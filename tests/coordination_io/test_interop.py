"""Wire compatibility with the reference (torchft's compiled extension), both directions.

Loads only ``torchft._torchft`` (the Rust extension) by file path, so the reference's Python
package and its optional dependencies are not imported. Without torchft: a loud skip, or a
failure in CI (``tests/reference.py``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
from datetime import timedelta
from types import ModuleType

import pytest

from tests.reference import missing_reference
from torchheal.coordination import LighthouseClient, ManagerClient

from .helpers import Background, loopback

pytestmark = pytest.mark.interop
T = timedelta(seconds=10)


def _load_reference() -> ModuleType | None:
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "_torchft*.so"))
    if not found:
        return None
    ext = importlib.util.spec_from_file_location("torchft._torchft", found[0])
    assert ext is not None and ext.loader is not None
    module = importlib.util.module_from_spec(ext)
    ext.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ref() -> ModuleType:
    module = _load_reference()
    if module is None:
        missing_reference("torchft (reference) is not installed")
    return module


def test_reference_client_with_our_lighthouse(ref, make_lighthouse):
    ours = make_lighthouse(min_replicas=1)
    client = ref.LighthouseClient(f"http://{loopback(ours)}", T)
    quorum = client.quorum(replica_id="ref", timeout=T, step=3, data={"my_data": 1234})
    assert quorum.quorum_id == 1
    (member,) = quorum.participants
    assert (member.replica_id, member.step, member.data) == ("ref", 3, {"my_data": 1234})


def test_our_client_with_reference_lighthouse(ref):
    theirs = ref.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        port = theirs.address().rsplit(":", 1)[1]
        client = LighthouseClient(f"127.0.0.1:{port}", T)
        quorum = client.quorum("ours", T, step=4, data={"b": 2})
        assert quorum.quorum_id == 1
        assert [(m.replica_id, m.step, m.data) for m in quorum.participants] == [
            ("ours", 4, {"b": 2})
        ]
        client.heartbeat("ours")
    finally:
        theirs.shutdown()


def test_reference_manager_with_our_lighthouse_and_client(ref, make_lighthouse):
    ours = make_lighthouse(min_replicas=1)
    manager = ref.ManagerServer(
        replica_id="refmgr",
        lighthouse_addr=f"http://{loopback(ours)}",
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="st:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=T,
        quorum_retries=0,
    )
    try:
        client = ManagerClient(manager.address(), T)
        result = client._quorum(0, 5, "meta", False, True, 2, T)
        assert (result.quorum_id, result.max_step, result.store_address) == (1, 5, "st:1")
        assert result.commit_failures == 2
        assert client._checkpoint_metadata(0, T) == "meta"
        assert client.should_commit(0, 5, True, T) is True
    finally:
        manager.shutdown()


def test_our_manager_with_reference_lighthouse_and_client(ref, make_manager):
    theirs = ref.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        port = theirs.address().rsplit(":", 1)[1]
        manager = make_manager(f"http://127.0.0.1:{port}", world_size=2, store_addr="st:2")
        client = ref.ManagerClient(manager.address(), T)
        kwargs = dict(
            step=7,
            checkpoint_metadata="m",
            shrink_only=False,
            init_sync=True,
            commit_failures=0,
            timeout=T,
        )
        try:
            calls = [
                Background(lambda r=r: client._quorum(group_rank=r, **kwargs)) for r in range(2)
            ]
            results = [c.join() for c in calls]
        except TypeError:
            # Newer reference builds add a required per-rank reconfigure handle.
            calls = [
                Background(
                    lambda r=r: client._quorum(group_rank=r, reconfigure_handle="", **kwargs)
                )
                for r in range(2)
            ]
            results = [c.join() for c in calls]
        assert [(r.quorum_id, r.max_step, r.store_address) for r in results] == [
            (1, 7, "st:2"),
            (1, 7, "st:2"),
        ]
        votes = [Background(lambda r=r: client.should_commit(r, 7, True, T)) for r in range(2)]
        assert [v.join() for v in votes] == [True, True]
    finally:
        theirs.shutdown()
