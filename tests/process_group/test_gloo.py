"""ProcessGroupGloo: the collective matrix, configure failures, reconfiguration, and surviving a
SIGKILLed peer (a real process) with an error instead of a hang."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp, ReduceScatterOptions

from tests import warm
from tests.process_group.helpers import collective_matrix, new_store, run_ranks, victim_main
from torchheal.process_group import ProcessGroupGloo


def _configure_all(pgs: list[ProcessGroupGloo], addr: str, prefix: str) -> None:
    world = len(pgs)
    run_ranks(world, lambda r: pgs[r].configure(f"{addr}/{prefix}", f"rep{r}", r, world))


def test_collective_matrix_world2() -> None:
    _store, addr = new_store()
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    _configure_all(pgs, addr, "matrix")
    assert pgs[0].size() == 2
    assert pgs[0].getBackendName() == "torchft-gloo"
    run_ranks(2, lambda r: collective_matrix(pgs[r], r, 2, gloo=True))
    assert all(pg.errored() is None for pg in pgs)
    with pytest.raises(RuntimeError, match="ProcessGroupGloo does not support reduce_scatter"):
        pgs[0].reduce_scatter([torch.zeros(1)], [[torch.zeros(1)] * 2], ReduceScatterOptions())
    with pytest.raises(RuntimeError, match="does not support reduce_scatter"):
        pgs[0].reduce_scatter_tensor_coalesced(
            [torch.zeros(1)], [torch.zeros(2)], ReduceScatterOptions()
        )
    for pg in pgs:
        pg.shutdown()


def test_configure_missing_peer_fails_within_timeout() -> None:
    _store, addr = new_store()
    pg = ProcessGroupGloo(timeout=timedelta(milliseconds=300))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?i)timeout|timed out"):
        pg.configure(f"{addr}/lonely", "rep0", 0, 2)
    assert time.monotonic() - start < 10


def test_configure_bad_address_is_value_error() -> None:
    with pytest.raises(ValueError, match="no '/prefix'"):
        ProcessGroupGloo().configure("127.0.0.1:1234", "rep0", 0, 1)


def test_reconfigure_with_new_world_size() -> None:
    _store, addr = new_store()
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(3)]
    _configure_all(pgs, addr, "gen1")
    first_inner = pgs[0].parent

    def _sum(r: int) -> float:
        t = torch.tensor([1.0])
        pgs[r].allreduce([t], ReduceOp.SUM).wait()
        return t.item()

    assert run_ranks(3, _sum) == [3.0] * 3
    _configure_all(pgs[:2], addr, "gen2")
    assert pgs[0].parent is not first_inner
    assert pgs[0].size() == 2
    assert run_ranks(2, _sum) == [2.0] * 2
    for pg in pgs:
        pg.shutdown()


def test_with_resiliency_sigkilled_peer() -> None:
    """3 ranks (rank 2 in its own process); rank 2 is SIGKILLed; survivors must error within
    their timeout, then reconfigure as a world of 2 and allreduce correctly."""
    _store, addr = new_store()
    ctx = warm.mp_context()
    parent_conn, child_conn = ctx.Pipe()
    victim = ctx.Process(
        target=victim_main, args=("gloo", f"{addr}/gen1", 2, 3, 30.0, child_conn), daemon=True
    )
    victim.start()
    try:
        timeout = timedelta(seconds=3)
        pgs = [ProcessGroupGloo(timeout=timeout) for _ in range(2)]
        assert parent_conn.poll(60) and parent_conn.recv() == "ready"

        def _gen1(r: int) -> float:
            pgs[r].configure(f"{addr}/gen1", f"rep{r}", r, 3)
            t = torch.tensor([r + 1.0])
            pgs[r].allreduce([t], ReduceOp.SUM).wait()
            return t.item()

        assert run_ranks(2, _gen1) == [6.0, 6.0]
        assert parent_conn.poll(30) and parent_conn.recv() == 6.0

        victim.kill()
        victim.join(10)

        def _after_kill(r: int) -> tuple[str, float]:
            start = time.monotonic()
            t = torch.tensor([1.0])
            try:
                pgs[r].allreduce([t], ReduceOp.SUM).wait()
            except Exception as e:
                return str(e), time.monotonic() - start
            return "", time.monotonic() - start

        results = run_ranks(2, _after_kill)
        for msg, elapsed in results:
            assert msg, "an allreduce with a dead peer must fail"
            # Fails by connection loss or by the operation timeout, never later.
            assert elapsed < timeout.total_seconds() + 5
        assert all(pg.errored() is not None for pg in pgs)

        def _gen2(r: int) -> float:
            pgs[r].configure(f"{addr}/gen2", f"rep{r}", r, 2)
            t = torch.tensor([r + 1.0])
            pgs[r].allreduce([t], ReduceOp.SUM).wait()
            return t.item()

        assert run_ranks(2, _gen2) == [3.0, 3.0]
        assert all(pg.errored() is None for pg in pgs)
        for pg in pgs:
            pg.shutdown()
    finally:
        if victim.is_alive():
            victim.kill()
        victim.join(10)


def test_under_stock_ddp() -> None:
    """Stock DDP over a configured group (world 1: C++ callers such as DDP's reducer read the
    size fixed when the Python object was built, see ProcessGroup's docstring)."""
    _store, addr = new_store()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(f"{addr}/ddp", "rep0", 0, 1)
    model = torch.nn.Linear(2, 1, bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    ddp(torch.full((1, 2), 3.0)).sum().backward()
    assert model.weight.grad.tolist() == [[3.0, 3.0]]
    pg.shutdown()
