"""ManagedProcessGroup routing: all-reduce to the manager, size from participation, the rest to
the manager's process group. The manager here is a recording double (the group under test only
calls ``allreduce``, ``num_participants`` and ``_pg``); the process group is a real one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.distributed_c10d import AllreduceOptions, BroadcastOptions, ReduceOp

from tests.cluster import lighthouse, replica
from torchheal.process_group import ManagedProcessGroup
from torchheal.process_group.dummy import ProcessGroupDummy
from torchheal.process_group.work import _DummyWork


class RecordingManager:
    def __init__(self) -> None:
        self._pg = ProcessGroupDummy()
        self.calls: list[tuple[torch.Tensor, str]] = []
        self.participants = 0

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None):
        self.calls.append((tensor, getattr(reduce_op, "op", reduce_op).name))
        return _DummyWork(tensor)

    def num_participants(self) -> int:
        return self.participants


def test_allreduce_goes_to_manager_with_its_op() -> None:
    manager = RecordingManager()
    pg = ManagedProcessGroup(manager)
    t = torch.ones(2)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.MAX
    assert pg.allreduce([t], opts).wait()
    pg.allreduce([t], ReduceOp.SUM).wait()
    pg.allreduce([t], ReduceOp(ReduceOp.AVG)).wait()
    assert [op for _, op in manager.calls] == ["MAX", "SUM", "AVG"]
    assert all(tensor is t for tensor, _ in manager.calls)


def test_allreduce_takes_exactly_one_tensor() -> None:
    pg = ManagedProcessGroup(RecordingManager())
    with pytest.raises(ValueError, match="exactly one tensor"):
        pg.allreduce([torch.ones(1), torch.ones(1)], ReduceOp.SUM)
    with pytest.raises(TypeError, match="AllreduceOptions or ReduceOp"):
        pg.allreduce([torch.ones(1)], "sum")  # type: ignore[arg-type]


def test_size_is_participants_and_backend_is_managers() -> None:
    manager = RecordingManager()
    pg = ManagedProcessGroup(manager)
    assert pg.size() == 0
    manager.participants = 3
    assert pg.size() == 3
    assert pg.getBackendName() == "torchft-dummy"
    assert repr(pg) == "ManagedProcessGroup(pg=ProcessGroupDummy())"


def test_other_collectives_use_managers_pg() -> None:
    manager = RecordingManager()
    pg = ManagedProcessGroup(manager)
    t = torch.arange(3.0)
    opts = BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()
    pg.broadcast_one(t, root=0).wait()
    assert manager._pg.wait_count == 2
    assert manager.calls == []
    with pytest.raises(RuntimeError, match="reconfigured by its manager"):
        pg.configure("localhost:1/x", "0", 0, 1)


def test_a_salvaging_manager_is_refused() -> None:
    # FSDP takes the reduced gradients before the vote; a salvaged redo would come too late.
    with lighthouse(min_replicas=1) as lh, replica(lh, "a", salvage_step=True) as a:
        with pytest.raises(ValueError, match="ManagedProcessGroup reads its reduced tensors"):
            ManagedProcessGroup(a.manager)
