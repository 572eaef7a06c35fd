"""Healing beside the step's collectives, and the warm-up of a group joining a running job.

Real Managers on threads, a real lighthouse and Gloo groups; a gate in the healer's transport
holds its transfer back, so what waits for the transfer and what does not is seen directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.cluster import Replica, lighthouse, new_store, replica, run_parallel, url
from tests.reference import import_reference
from torchheal._base.security import SecurityEnv
from torchheal.checkpointing import HTTPTransport
from torchheal.local_sgd import LocalSGD
from torchheal.manager import Manager
from torchheal.manager.recovery import metadata_over_grpc
from torchheal.process_group.gloo import ProcessGroupGloo

pytestmark = pytest.mark.timeout(90)

TIMEOUT = timedelta(seconds=10)


class GatedTransport(HTTPTransport):
    """HTTPTransport whose receive waits for ``gate`` first (a slow wire)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(TIMEOUT, 0, hostname="127.0.0.1")
        self.gate = gate

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: Any, **kwargs: Any
    ) -> Any:
        assert self.gate.wait(30), "the test never opened the gate"
        return super().recv_checkpoint(src_rank, metadata, step, timeout, **kwargs)


def _until(predicate: Callable[[], bool], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _allreduce_then_commit(r: Replica, grad: float, reduced: threading.Event) -> dict[str, Any]:
    m = r.manager
    m.start_quorum()
    g = torch.full((3,), grad)
    m.allreduce(g).wait()
    reduced.set()
    return {"grad": g, "participants": m.num_participants(), "committed": m.should_commit()}


def test_the_healers_collectives_do_not_wait_for_its_transfer() -> None:
    gate = threading.Event()
    reduced = {"a": threading.Event(), "b": threading.Event()}
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0) as a,
        replica(lh, "b", weight=0.0, checkpoint_transport=GatedTransport(gate)) as b,
    ):
        a.manager.load_state_dict({"step": 20, "batches_committed": 0})
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(_allreduce_then_commit, a, 2.0, reduced["a"])
            fb = pool.submit(_allreduce_then_commit, b, 5.0, reduced["b"])
            # Both reductions complete while the healer's transfer is still held back...
            both = _until(lambda: reduced["a"].is_set() and reduced["b"].is_set())
            # ...and the healer's vote waits for it (nothing loaded yet).
            loads_before_gate = list(b.loads)
            gate.set()
            res_a, res_b = fa.result(30), fb.result(30)
        assert both, "a reduction waited for the healer's transfer"
        assert loads_before_gate == []
        for res in (res_a, res_b):  # the healer sent zeros; only the source counts
            assert res["participants"] == 1 and res["committed"]
            assert torch.equal(res["grad"], torch.full((3,), 2.0))
        assert len(b.loads) == 1 and torch.equal(b.weight, torch.full((3,), 3.0))
        assert a.manager.current_step() == b.manager.current_step() == 21


def test_a_failed_transfer_beside_the_collectives_fails_the_healers_step() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0) as a,
        replica(lh, "b", weight=0.0) as b,
    ):
        a.manager.load_state_dict({"step": 20, "batches_committed": 0})

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("wire cut")

        b.manager._checkpoint_transport.recv_checkpoint = broken  # type: ignore[method-assign]
        events = [threading.Event(), threading.Event()]
        res_a, res_b = run_parallel(
            lambda: _allreduce_then_commit(a, 2.0, events[0]),
            lambda: _allreduce_then_commit(b, 5.0, events[1]),
        )
        assert res_a["committed"] and not res_b["committed"]
        assert b.loads == [] and torch.equal(b.weight, torch.zeros(3))
        assert b.manager.current_step() == 0  # nothing half-loaded: still behind, heals again
        assert "wire cut" in str(b.manager.errored())


def test_on_a_reference_lighthouse_the_collectives_still_wait_for_the_transfer() -> None:
    # A reference lighthouse drops a member that is late for the next round (its join
    # timeout): the healer must have loaded by then, so the step waits for the transfer.
    ref = import_reference()
    server = ref.LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100, heartbeat_timeout_ms=5000
    )
    lh_addr = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"

    class _Addr:  # tests.cluster.replica reaches the lighthouse through url(lh)
        def port(self) -> int:
            return int(lh_addr.rsplit(":", 1)[1])

    gate = threading.Event()
    reduced = {"a": threading.Event(), "b": threading.Event()}
    try:
        with (
            replica(_Addr(), "a", weight=3.0) as a,  # type: ignore[arg-type]
            replica(_Addr(), "b", weight=0.0, checkpoint_transport=GatedTransport(gate)) as b,  # type: ignore[arg-type]
        ):
            a.manager.load_state_dict({"step": 20, "batches_committed": 0})
            with ThreadPoolExecutor(2) as pool:
                fa = pool.submit(_allreduce_then_commit, a, 2.0, reduced["a"])
                fb = pool.submit(_allreduce_then_commit, b, 5.0, reduced["b"])
                # An observation window, not a synchronisation: with the transfer inside the
                # quorum, no reduction can finish before the gate opens, however long we look.
                early = _until(lambda: reduced["a"].is_set() or reduced["b"].is_set(), 1.0)
                gate.set()
                res_a, res_b = fa.result(30), fb.result(30)
            assert not early, "a reduction finished before the healer's transfer"
            assert res_a["committed"] and res_b["committed"]
            assert torch.equal(b.weight, torch.full((3,), 3.0))
    finally:
        server.shutdown()


def _local_step(r: Replica, grad: float) -> dict[str, Any]:
    m = r.manager
    m.start_quorum()
    g = torch.full((3,), grad)
    m.allreduce(g).wait()
    return {
        "grad": g,
        "participants": m.num_participants(),
        "participating": m.is_participating(),
        "committed": m.should_commit(),
    }


def _join_while_a_trains(lh: Any, a: Replica, b: Replica) -> dict[str, Any]:
    """b's next step and a's, b asking first (a round without b's request would go without it).

    Returns b's step.
    """
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(_local_step, b, 4.0)
        assert _until(lambda: any(w.startswith("b:") for w in lh.status()["waiting"]))
        assert _local_step(a, 2.0)["committed"]
        return joining.result(30)


def test_a_group_joining_a_running_job_warms_up_alone_first() -> None:
    with lighthouse(min_replicas=1) as lh, replica(lh, "a", weight=3.0) as a:
        assert _local_step(a, 1.0)["committed"]  # the job runs: a quorum was issued
        with replica(lh, "b", weight=0.0) as b:
            warm = _local_step(b, 5.0)
            # No quorum, no communication: the gradient is left as it was, nothing counts.
            assert torch.equal(warm.pop("grad"), torch.full((3,), 5.0))
            assert warm == {"participants": 0, "participating": False, "committed": False}
            assert b.manager.current_step() == 0 and b.manager._commit_failures == 0
            assert a.manager.current_step() == 1  # a went on without waiting for b
            # The next step joins (whichever round of a's it catches) and heals...
            _join_while_a_trains(lh, a, b)
            assert torch.equal(b.weight, torch.full((3,), 3.0))
            assert a.manager.current_step() == b.manager.current_step()
            # ...and the one after trains together.
            res_a, res_b = run_parallel(lambda: _local_step(a, 2.0), lambda: _local_step(b, 4.0))
            assert res_a["participants"] == res_b["participants"] == 2
            assert torch.equal(res_b["grad"], torch.full((3,), 3.0))


def test_a_group_starting_with_the_job_does_not_warm_up() -> None:
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0) as a,
        replica(lh, "b", weight=0.0) as b,
    ):
        res_a, res_b = run_parallel(lambda: _local_step(a, 2.0), lambda: _local_step(b, 4.0))
        assert res_a["committed"] and res_b["committed"]


def test_skip_warmup_joins_at_once() -> None:
    with lighthouse(min_replicas=1) as lh, replica(lh, "a", weight=3.0) as a:
        assert _local_step(a, 1.0)["committed"]
        with replica(lh, "b", weight=0.0) as b:
            b.manager.skip_warmup()
            assert _join_while_a_trains(lh, a, b)["committed"]  # its very first step
            assert torch.equal(b.weight, torch.full((3,), 3.0))


def test_every_rank_of_a_group_warms_up_together() -> None:
    # A group of two ranks joining a running job: rank 1 learns the decision from the store.
    with lighthouse(min_replicas=1) as lh, replica(lh, "a", weight=3.0) as a:
        assert _local_step(a, 1.0)["committed"]
        store = new_store()
        made: list[Future[Manager]] = []
        with ThreadPoolExecutor(2) as pool:
            for rank in range(2):
                made.append(
                    pool.submit(
                        Manager,
                        pg=ProcessGroupGloo(timeout=TIMEOUT),
                        load_state_dict=lambda s: None,
                        state_dict=lambda: {"w": torch.zeros(1)},
                        min_replica_size=1,
                        timeout=TIMEOUT,
                        quorum_timeout=TIMEOUT,
                        connect_timeout=TIMEOUT,
                        rank=rank,
                        world_size=2,
                        store_addr="127.0.0.1",
                        store_port=store.port,
                        lighthouse_addr=url(lh),
                        replica_id="b",
                    )
                )
            managers = [f.result(30) for f in made]
        try:
            for m in managers:
                m.start_quorum()
                assert m.num_participants() == 0 and not m.should_commit()
        finally:
            for m in managers:
                m.shutdown(wait=False)


def test_metadata_is_fetched_from_the_sources_server() -> None:
    with lighthouse(min_replicas=1) as lh, replica(lh, "a", weight=3.0) as a:
        _local_step(a, 1.0)  # a reported its metadata with its quorum request
        fetch = metadata_over_grpc(TIMEOUT, SecurityEnv())
        address = a.manager._endpoints.server.address()
        assert fetch(address, 0, TIMEOUT) == a.manager._checkpoint_transport.metadata()
        with pytest.raises(RuntimeError, match="rank not found"):
            fetch(address, 3, TIMEOUT)


def test_localsgd_heals_at_its_first_sync_without_a_warm_up() -> None:
    # LocalSGD's first sync comes after local steps: the warm-up is done by then.
    with lighthouse(min_replicas=1) as lh, replica(lh, "a", weight=3.0) as a:
        assert _local_step(a, 1.0)["committed"]
        with replica(lh, "b", weight=0.0) as b:
            model = torch.nn.Linear(2, 2)
            LocalSGD(b.manager, model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
            assert _join_while_a_trains(lh, a, b)["committed"]
            assert torch.equal(b.weight, torch.full((3,), 3.0))


@pytest.mark.parametrize("step, in_place", [(0, True), (5, False)])
def test_a_restarted_group_receives_into_its_own_tensors(step: int, in_place: bool) -> None:
    """A group at step 0 that never committed holds nothing worth keeping: its heal lands in
    its own tensors (the state it loads is its own weight, filled in). One that committed
    before keeps receiving into fresh memory: its state survives a heal that fails."""
    with (
        lighthouse(min_replicas=2) as lh,
        replica(lh, "a", weight=3.0) as a,
        replica(lh, "b", weight=0.0) as b,
    ):
        a.manager.load_state_dict({"step": 20, "batches_committed": 20})
        b.manager.load_state_dict({"step": step, "batches_committed": step})
        received: list[bool] = []
        load = b.load

        def spy(state: dict[str, torch.Tensor]) -> None:
            received.append(state["weight"] is b.weight)
            load(state)

        b.load = spy  # type: ignore[method-assign]
        events = [threading.Event(), threading.Event()]
        res_a, res_b = run_parallel(
            lambda: _allreduce_then_commit(a, 2.0, events[0]),
            lambda: _allreduce_then_commit(b, 5.0, events[1]),
        )
        assert res_a["committed"] and res_b["committed"]
        assert received == [in_place] and torch.equal(b.weight, torch.full((3,), 3.0))
