"""Process group API surface: base class, store addresses, Dummy under stock DDP, wrappers,
registration with torch.distributed, and NCCL construction (GPU paths marked)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

from tests.process_group.helpers import new_store
from torchheal.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
    _DummyWork,
    create_store_client,
)
from torchheal.process_group.store import parse_store_addr


def test_base_collectives_not_implemented() -> None:
    pg = ProcessGroup()
    assert repr(pg) == "ProcessGroup()"
    assert pg.errored() is None
    with pytest.raises(NotImplementedError):
        pg.allreduce([torch.zeros(1)], ReduceOp.SUM)
    with pytest.raises(NotImplementedError):
        pg.broadcast_one(torch.zeros(1), 0)
    with pytest.raises(NotImplementedError):
        pg.configure("a:1/p", "r", 0, 1)
    with pytest.raises(ValueError, match="name not set"):
        _ = pg.group_name


@pytest.mark.parametrize(
    ("addr", "want"),
    [
        ("localhost:1234/a", ("localhost", 1234, "a")),
        ("[::1]:1234/torchft/3/0", ("::1", 1234, "torchft/3/0")),
        ("10.0.0.1:80/x/y", ("10.0.0.1", 80, "x/y")),
    ],
)
def test_parse_store_addr(addr: str, want: tuple[str, int, str]) -> None:
    assert parse_store_addr(addr) == want


@pytest.mark.parametrize(
    ("addr", "error"),
    [
        ("localhost:1234", "no '/prefix'"),
        ("localhost/a", "no host:port"),
        ("localhost:abc/a", "non-numeric port"),
        ("::1:1234/a", "must be written as"),
        ("[::1:1234/a", "unclosed"),
        ("host:70000/a", "out of range"),
    ],
)
def test_parse_store_addr_errors(addr: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_store_addr(addr)


def test_create_store_client_prefixes_keys() -> None:
    store, addr = new_store()
    client = create_store_client(f"{addr}/quorum/7", timedelta(seconds=5))
    client.set("k", b"v")
    assert store.get("quorum/7/k") == b"v"


def test_dummy_counts_and_copies() -> None:
    pg = ProcessGroupDummy()
    assert pg.size() == 1 and pg.getBackendName() == "torchft-dummy"
    out = [[torch.zeros(2)]]
    work = pg.allgather(out, [torch.ones(2)], None)
    assert work.wait() and pg.wait_count == 1
    assert out[0][0].tolist() == [1.0, 1.0]
    t = torch.tensor([3.0])
    assert pg.allreduce([t], ReduceOp.SUM).get_future().wait() == [t]
    assert t.item() == 3.0 and pg.get_future_count == 1
    pg.configure("a:1/p", "r", 0, 1)
    assert pg.configure_count == 1
    with pytest.raises(ValueError, match="rank 0 and world 1"):
        ProcessGroupDummy(rank=1, world=2)


def test_dummy_under_stock_ddp() -> None:
    pg = ProcessGroupDummy()
    model = torch.nn.Linear(3, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    ddp(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None
    # DDP's init broadcast and the gradient allreduce both went through the dummy group.
    assert pg.wait_count + pg.get_future_count > 0


def test_wrapper_repr_and_delegation() -> None:
    wrapper = ProcessGroupWrapper(pg=ProcessGroupDummy())
    assert repr(wrapper) == "ProcessGroupWrapper(pg=ProcessGroupDummy())"
    assert wrapper.size() == 1
    assert wrapper.getBackendName() == "torchft-dummy"
    t = torch.tensor([2.0])
    assert wrapper.allreduce([t], ReduceOp.SUM).wait()
    wrapper.configure("a:1/p", "r", 0, 1)
    assert wrapper.parent.configure_count == 1
    with pytest.raises(AssertionError, match="process group not initialized"):
        _ = ProcessGroupWrapper().parent


def test_error_swallowing_wrapper() -> None:
    inner = FakeProcessGroupWrapper(ProcessGroupDummy())
    pg = ErrorSwallowingProcessGroupWrapper(inner)
    t = torch.tensor([1.0])
    assert pg.allreduce([t], ReduceOp.SUM).wait()
    assert pg.error() is None
    inner.report_future_error(RuntimeError("boom"))
    assert pg.allreduce([t], ReduceOp.SUM).wait()
    assert str(pg.error()) == "boom"
    # Once errored, allreduce completes at once with its inputs.
    work = pg.allreduce([t], ReduceOp.SUM)
    assert isinstance(work, _DummyWork)
    assert work.get_future().wait() == [t]
    pg.configure("a:1/p", "r", 0, 1)
    assert pg.error() is None
    inner.report_future_error(RuntimeError("via future"))
    assert pg.allreduce([t], ReduceOp.SUM).get_future().wait() == [t]
    assert str(pg.error()) == "via future"


def test_fake_wrapper_injects_one_error() -> None:
    pg = FakeProcessGroupWrapper(ProcessGroupDummy())
    pg.report_future_error(RuntimeError("injected"))
    work = pg.allreduce([torch.zeros(1)], AllreduceOptions())
    with pytest.raises(RuntimeError, match="injected"):
        work.wait()
    with pytest.raises(RuntimeError, match="injected"):
        work.get_future().wait()
    assert pg.allreduce([torch.zeros(1)], ReduceOp.SUM).wait()
    pg.report_future_error(RuntimeError("cleared"))
    pg.configure("a:1/p", "r", 0, 1)
    assert pg.allreduce([torch.zeros(1)], ReduceOp.SUM).wait()


@pytest.fixture
def default_pg():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_register_and_functional_collectives(default_pg: None) -> None:
    import torch.distributed._functional_collectives as fc
    from torch.distributed.distributed_c10d import _resolve_process_group

    _store, addr = new_store()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(f"{addr}/reg", "rep0", 0, 1)
    group = pg.register("test_register")
    assert group is pg
    assert _resolve_process_group(pg.group_name) is pg
    out = fc.all_reduce(torch.full((3,), 2.0), "sum", pg.group_name)
    assert fc.wait_tensor(out).tolist() == [2.0, 2.0, 2.0]
    pg.unregister()
    with pytest.raises(ValueError, match="name not set"):
        _ = pg.group_name
    pg.shutdown()


def test_nccl_constructs_on_cpu_machine() -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=1))
    assert pg.getBackendName() == "torchft-nccl"
    assert pg.errored() is None
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            pg.configure("127.0.0.1:1/x", "rep0", 0, 1)


def test_nccl_abort_reports_aborted() -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=1))
    pg.abort()
    assert str(pg.errored()) == "aborted"


@pytest.mark.gpu
def test_nccl_allreduce_and_reconfigure() -> None:
    store, addr = new_store()
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    for gen in range(2):
        pg.configure(f"{addr}/nccl{gen}", "rep0", 0, 1)
        assert pg.errored() is None
        t = torch.full((4,), float(gen + 1), device="cuda")
        pg.allreduce([t], ReduceOp.SUM).wait()
        torch.cuda.synchronize()
        assert t.tolist() == [float(gen + 1)] * 4
    pg.shutdown()
    del store
