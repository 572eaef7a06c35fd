"""ProcessGroupBabyGloo: the communicator runs in a child process that is replaced on every
configure. Covers the collective matrix, configure timeout, child replacement, work cleanup,
use after shutdown, and surviving a SIGKILLed peer child."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from torch.distributed.distributed_c10d import ReduceOp, ReduceScatterOptions

from tests.process_group.helpers import collective_matrix, new_store, run_ranks
from torchheal.process_group import ProcessGroupBabyGloo, ProcessGroupBabyNCCL


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[list[ProcessGroupBabyGloo], str]]:
    """Two baby groups configured as a world of 2 (children are slow to start: shared)."""
    store, addr = new_store()
    pgs = [ProcessGroupBabyGloo(timeout=timedelta(seconds=30)) for _ in range(2)]
    run_ranks(2, lambda r: pgs[r].configure(f"{addr}/pair0", f"rep{r}", r, 2))
    yield pgs, addr
    for pg in pgs:
        pg.shutdown()
    del store


def test_collective_matrix_world2(pair: tuple[list[ProcessGroupBabyGloo], str]) -> None:
    pgs, _ = pair
    assert pgs[0].size() == 2
    assert pgs[0].getBackendName() == "torchft-baby-gloo"
    run_ranks(2, lambda r: collective_matrix(pgs[r], r, 2, gloo=True))
    assert all(pg.errored() is None for pg in pgs)
    with pytest.raises(RuntimeError, match="does not support reduce_scatter"):
        pgs[0].reduce_scatter([torch.zeros(1)], [[torch.zeros(1)] * 2], ReduceScatterOptions())


def test_future_resolves_with_outputs(pair: tuple[list[ProcessGroupBabyGloo], str]) -> None:
    pgs, _ = pair

    def _run(r: int) -> list[float]:
        t = torch.tensor([2.0 * (r + 1)])
        value = pgs[r].allreduce([t], ReduceOp.SUM).get_future().wait()
        assert value[0] is t
        return t.tolist()

    assert run_ranks(2, _run) == [[6.0], [6.0]]


def test_inputs_must_be_lists(pair: tuple[list[ProcessGroupBabyGloo], str]) -> None:
    pgs, _ = pair
    with pytest.raises(TypeError, match="must be a list"):
        pgs[0].allreduce(torch.zeros(1), ReduceOp.SUM)


def test_works_released_after_gc(pair: tuple[list[ProcessGroupBabyGloo], str]) -> None:
    pgs, _ = pair

    def _run(r: int) -> None:
        for _ in range(3):
            work = pgs[r].allreduce([torch.ones(2)], ReduceOp.SUM)
            work.wait()
            work.get_future().wait()
            del work

    run_ranks(2, _run)
    gc.collect()
    assert [pg.num_active_work() for pg in pgs] == [0, 0]


def test_reconfigure_replaces_child_and_closes_old(
    pair: tuple[list[ProcessGroupBabyGloo], str],
) -> None:
    pgs, addr = pair
    old = [(pg._p, pg._future_thread, pg._pipe, pg._future_pipe) for pg in pgs]
    run_ranks(2, lambda r: pgs[r].configure(f"{addr}/pair1", f"rep{r}", r, 2))
    for pg, (proc, thread, pipe, fut_pipe) in zip(pgs, old, strict=True):
        assert pg._p is not proc and not proc.is_alive()
        assert pg._future_thread is not thread and not thread.is_alive()
        assert pg._pipe is not pipe and pipe.closed()
        assert fut_pipe.closed()

    def _sum(r: int) -> float:
        t = torch.tensor([1.0])
        pgs[r].allreduce([t], ReduceOp.SUM).wait()
        return t.item()

    assert run_ranks(2, _sum) == [2.0, 2.0]


def test_configure_timeout() -> None:
    _store, addr = new_store()
    pg = ProcessGroupBabyGloo(timeout=timedelta(milliseconds=10))
    with pytest.raises(TimeoutError, match=r"timed out after 0\.01 seconds"):
        pg.configure(f"{addr}/never", "rep0", 0, 2)
    # The half-started child was killed, not leaked.
    assert pg._p is None


def test_ops_after_shutdown_fail_with_closed_handle() -> None:
    _store, addr = new_store()
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=30))
    pg.configure(f"{addr}/solo", "rep0", 0, 1)
    t = torch.tensor([5.0])
    pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.item() == 5.0
    pg.shutdown()
    with pytest.raises(OSError, match="handle is closed"):
        pg.allreduce([t], ReduceOp.SUM)


def test_with_resiliency_sigkilled_peer_child() -> None:
    """3 ranks; rank 2's child process is SIGKILLed; survivors error within their timeout,
    then reconfigure as a world of 2 and allreduce correctly."""
    _store, addr = new_store()
    pgs = [ProcessGroupBabyGloo(timeout=timedelta(seconds=30)) for _ in range(3)]

    def _gen(r: int, world: int, prefix: str) -> float:
        pgs[r].configure(f"{addr}/{prefix}", f"rep{r}", r, world)
        t = torch.tensor([r + 1.0])
        pgs[r].allreduce([t], ReduceOp.SUM).wait()
        return t.item()

    try:
        assert run_ranks(3, lambda r: _gen(r, 3, "gen1")) == [6.0] * 3
        os.kill(pgs[2]._p.pid, signal.SIGKILL)
        pgs[2]._p.join(10)
        timeout = timedelta(seconds=2)

        def _after_kill(r: int) -> tuple[str, float]:
            start = time.monotonic()
            try:
                pgs[r].allreduce([torch.ones(1)], ReduceOp.SUM).wait(timeout)
            except Exception as e:
                return f"{type(e).__name__}: {e}", time.monotonic() - start
            return "", time.monotonic() - start

        for msg, elapsed in run_ranks(2, _after_kill):
            assert msg, "an allreduce with a dead peer must fail"
            assert elapsed < timeout.total_seconds() + 5
        assert all(pgs[r].errored() is not None for r in range(2))

        assert run_ranks(2, lambda r: _gen(r, 2, "gen2")) == [3.0, 3.0]
        assert all(pgs[r].errored() is None for r in range(2))
    finally:
        for pg in pgs:
            pg.shutdown()


def test_baby_nccl_constructs_without_cuda() -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=1))
    assert pg.getBackendName() == "torchft-baby-nccl"
    assert pg.size() == -1
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            pg.configure("127.0.0.1:1/x", "rep0", 0, 1)


@pytest.mark.gpu
def test_baby_nccl_allreduce_cuda() -> None:
    _store, addr = new_store()
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=60))
    pg.configure(f"{addr}/nccl", "rep0", 0, 1)
    t = torch.full((4,), 3.0, device="cuda")
    pg.allreduce([t], ReduceOp.SUM).wait()
    torch.cuda.synchronize()
    assert t.tolist() == [3.0] * 4
    pg.shutdown()
