"""_ErrorRecordingWork: failures reach every reporter, with one callback per collective."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.futures import Future

from torchheal.process_group.work import _ErrorRecordingWork


class _Work(dist.Work):
    """A work whose future the test completes; counts how often its future is asked for."""

    def __init__(self, wait_error: Exception | None = None) -> None:
        super().__init__()
        self.future: Future[Any] = Future()
        self.futures_asked = 0
        self.wait_error = wait_error

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.wait_error is not None:
            raise self.wait_error
        return True

    def get_future(self) -> Future[Any]:
        self.futures_asked += 1
        return self.future


def test_nested_recorders_report_in_order_from_the_future() -> None:
    seen: list[tuple[str, str]] = []
    raw = _Work()
    inner = _ErrorRecordingWork(raw, lambda e: seen.append(("pg", str(e))))
    outer = _ErrorRecordingWork(inner, lambda e: seen.append(("manager", str(e))))
    fut = outer.get_future()
    # Adopted, not nested: one chain on the collective's own future.
    assert outer._work is raw
    assert raw.futures_asked == 1
    raw.future.set_exception(RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        fut.wait()
    assert seen == [("pg", "peer gone"), ("manager", "peer gone")]


def test_nested_recorders_report_from_wait() -> None:
    seen: list[str] = []
    inner = _ErrorRecordingWork(_Work(RuntimeError("timeout")), lambda e: seen.append("pg"))
    outer = _ErrorRecordingWork(inner, lambda e: seen.append("manager"))
    with pytest.raises(RuntimeError, match="timeout"):
        outer.wait()
    assert seen == ["pg", "manager"]


def test_a_recorder_whose_future_exists_is_wrapped_not_adopted() -> None:
    seen: list[str] = []
    raw = _Work()
    inner = _ErrorRecordingWork(raw, lambda e: seen.append("pg"))
    inner_fut = inner.get_future()
    outer = _ErrorRecordingWork(inner, lambda e: seen.append("manager"))
    assert outer._work is inner
    fut = outer.get_future()
    raw.future.set_exception(RuntimeError("x"))
    with pytest.raises(RuntimeError):
        fut.wait()
    with pytest.raises(RuntimeError):
        inner_fut.wait()
    assert seen == ["pg", "manager"]  # each reporter once
    ok = _ErrorRecordingWork(_Work(), lambda e: seen.append("never"))
    ok_fut = ok.get_future()
    ok._work.future.set_result(5)
    assert ok_fut.wait() == 5
