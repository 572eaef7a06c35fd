"""Process-group behaviour the reference's tests pin (issue 43): a wrapper around a torchheal
group returns the inner work as it is (the inner group keeps its errors), and the dummy group
pairs lists of unequal length as far as the shorter goes."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions

from torchheal.checkpointing.rwlock import RWLock
from torchheal.manager.views import ReferenceViews
from torchheal.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupDummy,
    _DummyWork,
    _ErrorSwallowingWork,
)
from torchheal.process_group.work import _ErrorRecordingWork


def test_wrapper_of_a_torchheal_group_returns_its_work() -> None:
    wrapper = ErrorSwallowingProcessGroupWrapper(ProcessGroupDummy(0, 1))
    t = torch.ones(2)
    assert isinstance(wrapper.allreduce([t], AllreduceOptions()), _ErrorSwallowingWork)
    work = wrapper.allgather([[torch.zeros(2)]], [t], AllgatherOptions())
    assert isinstance(work, _DummyWork) and not isinstance(work, _ErrorRecordingWork)
    wrapper.report_error(RuntimeError("test"))
    assert isinstance(wrapper.allreduce([t], AllreduceOptions()), _DummyWork)
    assert wrapper.errored() is None  # the dummy itself never failed


def test_dummy_pairs_unequal_lists_as_far_as_the_shorter() -> None:
    pg = ProcessGroupDummy(0, 1)
    outs = [torch.zeros(3) for _ in range(4)]
    pg.allgather_into_tensor_coalesced(outs, [torch.ones(3)], AllgatherOptions()).wait()
    assert outs[0].tolist() == [1.0, 1.0, 1.0]
    assert all(o.tolist() == [0.0, 0.0, 0.0] for o in outs[1:])


def test_reference_views_init_sync_and_lock_are_settable() -> None:
    class Host(ReferenceViews):
        def __init__(self) -> None:
            self._worker = SimpleNamespace(_init_sync=False)
            self._state = SimpleNamespace(lock=RWLock())

    host = Host()
    assert host._init_sync is False
    host._init_sync = True
    assert host._worker._init_sync is True
    lock = RWLock()
    host._state_dict_lock = lock
    assert host._state.lock is lock
