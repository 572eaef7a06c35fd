"""Salvage in replica groups of two ranks: every rank of a group redoes the step, or none does.

Two groups ("a", "b") of two ranks each, on threads of this process, against a real lighthouse
and real Gloo groups (rank r of one group reduces with rank r of the other). In step 1, group b
leaves after its collectives went through, and the collective of a's rank 0 reports a failure
(``FakeProcessGroupWrapper``), as one does whose peer reset just after the last byte; a's rank 1
sees nothing wrong. Rank 0's "no" says a redo would cure it (group b is lost), so the group's
vote answers "redo": both ranks redo the step in a new quorum without b, rank 1 too, from its
kept input, and both commit it, averaged over group a alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch

from tests.cluster import TIMEOUT, lighthouse, new_store, url
from torchheal.coordination.lighthouse.server import LighthouseServer
from torchheal.manager import Manager
from torchheal.process_group.gloo import ProcessGroupGloo
from torchheal.process_group.wrappers import FakeProcessGroupWrapper

pytestmark = pytest.mark.timeout(60)

BOUND_S = TIMEOUT.total_seconds()


@contextmanager
def two_ranks(lh: LighthouseServer, name: str, salvage: bool = True) -> Iterator[list[Manager]]:
    """A replica group of two ranks (one store, a Manager per rank), each with a fake-able PG."""
    store = new_store()

    def manager(rank: int) -> Manager:
        return Manager(
            pg=FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT)),
            load_state_dict=lambda _: None,
            state_dict=lambda: {},
            min_replica_size=1,
            timeout=TIMEOUT,
            quorum_timeout=TIMEOUT,
            connect_timeout=TIMEOUT,
            store_addr="127.0.0.1",
            store_port=store.port,
            rank=rank,
            world_size=2,
            lighthouse_addr=url(lh),
            replica_id=name,
            salvage_step=salvage,
        )

    with ThreadPoolExecutor(2) as pool:
        managers = list(pool.map(manager, range(2)))
    try:
        yield managers
    finally:
        for m in managers:
            m.shutdown(wait=False)


def on_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Runs the calls at once (ranks and groups meet in collectives and votes)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result(timeout=BOUND_S) for f in futures]


def value(group: int, rank: int, step: int, device: str = "cpu") -> torch.Tensor:
    return torch.full((4,), float(100 * step + 10 * group + rank), device=device)


def reduce(m: Manager, t: torch.Tensor) -> torch.Tensor:
    m.start_quorum()
    m.allreduce(t).wait()
    return t


def run_step_1(
    lh: LighthouseServer, a: list[Manager], b: list[Manager], fail: Callable, device: str = "cpu"
) -> list:
    """Step 0 with both groups; in step 1, b leaves once reduced and ``fail`` hits a's rank 0."""
    groups = {0: a, 1: b}
    on_threads(
        [
            lambda g=g, r=r: (
                reduce(groups[g][r], value(g, r, 0, device)),
                groups[g][r].should_commit(),
            )
            for g in (0, 1)
            for r in (0, 1)
        ]
    )
    assert [m.current_step() for m in a + b] == [1] * 4
    a[0]._pg.report_future_error(RuntimeError("injected: the peer reset after the last byte"))
    tensors = [value(0, r, 1, device) for r in (0, 1)]
    on_threads(
        [lambda r=r: reduce(a[r], tensors[r]) for r in (0, 1)]
        + [lambda r=r: reduce(b[r], value(1, r, 1, device)) for r in (0, 1)]
    )
    fail(a[0])
    for m in b:
        m.shutdown()  # b leaves: the lighthouse tells a, whose groups are aborted
    for m in a:
        assert m._connected.wait_aborted(BOUND_S) is not None, "no notice that b is gone"
    return tensors


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_rank_of_the_group_redoes_the_step_one_rank_failed(
    caplog: pytest.LogCaptureFixture, device: str
) -> None:
    """On CUDA too: the kept inputs are device copies, replayed into the CUDA tensors (Gloo
    reduces CUDA tensors between the groups, which share one GPU)."""
    with lighthouse(min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=5_000) as lh:
        with ExitStack() as stack:
            a = stack.enter_context(two_ranks(lh, "a"))
            b = stack.enter_context(two_ranks(lh, "b"))
            tensors = run_step_1(lh, a, b, fail=lambda m: None, device=device)
            assert a[0].errored() is not None and a[1].errored() is None
            with caplog.at_level(logging.INFO):
                committed = on_threads([m.should_commit for m in a])
            assert committed == [True, True], caplog.text
            assert [m.current_step() for m in a] == [2, 2]
            # Redone without b: each rank's sum holds group a's own input alone.
            for r in (0, 1):
                torch.testing.assert_close(tensors[r], value(0, r, 1, device), rtol=0, atol=0)
            salvaged = [rec for rec in caplog.records if "salvaging step 1" in rec.getMessage()]
            assert len(salvaged) == 2, caplog.text
            assert any("every rank redoes it" in rec.getMessage() for rec in caplog.records)


def test_a_failure_no_redo_cures_keeps_the_whole_group_from_redoing() -> None:
    with lighthouse(min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=5_000) as lh:
        with ExitStack() as stack:
            a = stack.enter_context(two_ranks(lh, "a"))
            b = stack.enter_context(two_ranks(lh, "b"))
            # The loop itself reports a failure on rank 0 (a nan loss, say): no new quorum cures
            # it, so rank 1 must not redo either; the step is skipped by both.
            run_step_1(lh, a, b, fail=lambda m: m.report_error(ValueError("loss is nan")))
            assert on_threads([m.should_commit for m in a]) == [False, False]
            assert [m.current_step() for m in a] == [1, 1]
