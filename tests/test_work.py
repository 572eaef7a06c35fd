"""_ManagedWork: a lazy, ordered, error-swallowing callback chain over a process-group work."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchheal.futures import future_timeout
from torchheal.work import _ManagedFuture, _ManagedWork


class _Sink:
    """The two Manager methods a managed work uses, with the Manager's semantics."""

    def __init__(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        self.errors: list[Exception] = []
        self.timeout = timeout

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def wrap_future(
        self, fut: torch.futures.Future[Any], default: Any, timeout: timedelta | None = None
    ) -> torch.futures.Future[Any]:
        fut = future_timeout(fut, timeout or self.timeout)

        def swallow(f: torch.futures.Future[Any]) -> Any:
            try:
                return f.value()
            except Exception as e:
                self.report_error(e)
                return default

        return fut.then(swallow)


class _ControlledWork(dist.Work):
    """A work whose future the test completes; records how it was waited."""

    def __init__(self, wait_error: Exception | None = None) -> None:
        super().__init__()
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self.wait_timeouts: list[timedelta | None] = []
        self.wait_error = wait_error

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.wait_timeouts.append(timeout)
        if self.wait_error is not None:
            raise self.wait_error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future


def test_callbacks_run_only_after_wait_in_order_with_type_changes() -> None:
    sink = _Sink()
    work = _ControlledWork()
    tensor = torch.ones(2)
    managed = _ManagedWork(sink, work, tensor)
    calls: list[tuple[str, Any]] = []

    def first(f: torch.futures.Future[Any]) -> torch.Tensor:
        calls.append(("first", f.value()))
        return tensor * 2

    def second(f: torch.futures.Future[Any]) -> int:
        calls.append(("second", f.value()))
        return int(f.value().sum().item())

    def third(f: torch.futures.Future[Any]) -> str:
        calls.append(("third", f.value()))
        return f"sum={f.value()}"

    tail = managed.get_future().then(first).then(second).then(third)
    assert isinstance(tail, _ManagedFuture)
    assert managed.get_future() is tail
    work.future.set_result([tensor])
    assert calls == []  # nothing runs before someone waits

    assert managed.wait() is True
    assert [name for name, _ in calls] == ["first", "second", "third"]
    assert calls[0][1][0] is tensor
    assert torch.equal(calls[1][1], torch.full((2,), 2.0))
    assert calls[2][1] == 4
    assert tail.wait() == "sum=4"
    assert sink.errors == []


def test_late_completion_on_another_thread_runs_each_nodes_own_callback() -> None:
    sink = _Sink()
    work = _ControlledWork()
    managed = _ManagedWork(sink, work, 0)
    seen: list[tuple[int, int, str]] = []
    fut = managed.get_future()
    for i in range(5):

        def cb(f: torch.futures.Future[Any], i: int = i) -> int:
            seen.append((i, f.value(), threading.current_thread().name))
            return f.value() + 1

        fut = fut.then(cb)
    managed._materialize()  # chain built; the collective has not completed yet

    completer = threading.Thread(target=work.future.set_result, args=(0,), name="completer")
    completer.start()
    completer.join(timeout=10)
    assert managed.wait() is True
    assert [(i, v) for i, v, _ in seen] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    assert fut.wait() == 5


def test_wait_passes_timeout_through() -> None:
    work = _ControlledWork()
    managed = _ManagedWork(_Sink(), work, 0)
    work.future.set_result(0)
    assert managed.wait(timeout=timedelta(seconds=3)) is True
    assert managed.wait() is True
    assert work.wait_timeouts == [timedelta(seconds=3), None]


def test_collective_error_is_swallowed_into_the_default() -> None:
    sink = _Sink()
    work = _ControlledWork()
    tensor = torch.zeros(3)
    managed = _ManagedWork(sink, work, tensor)
    tail = managed.get_future().then(lambda f: f.value() + 1)
    work.future.set_exception(RuntimeError("peer died"))
    assert managed.wait() is True
    assert tail.wait() is tensor  # the default value, not an exception
    assert len(sink.errors) == 1 and "peer died" in str(sink.errors[0])


def test_error_in_later_callback_is_reported_and_wait_returns_false() -> None:
    sink = _Sink()
    work = _ControlledWork()
    managed = _ManagedWork(sink, work, 0)

    def boom(f: torch.futures.Future[Any]) -> int:
        raise ValueError("bad callback")

    managed.get_future().then(lambda f: f.value()).then(boom)
    work.future.set_result(1)
    assert managed.wait() is False
    assert len(sink.errors) == 1 and "bad callback" in str(sink.errors[0])


def test_work_wait_error_is_reported() -> None:
    sink = _Sink()
    managed = _ManagedWork(sink, _ControlledWork(wait_error=RuntimeError("gloo timeout")), 0)
    assert managed.wait() is False
    assert [str(e) for e in sink.errors] == ["gloo timeout"]


def test_timeout_of_the_first_continuation() -> None:
    sink = _Sink(timeout=timedelta(milliseconds=10))
    work = _ControlledWork()  # never completes
    managed = _ManagedWork(sink, work, "default")
    tail = managed.get_future().then(lambda f: f.value())
    assert managed.wait() is True
    assert tail.wait() == "default"
    assert len(sink.errors) == 1 and isinstance(sink.errors[0], TimeoutError)


def test_then_after_materialisation_extends_the_chain() -> None:
    work = _ControlledWork()
    managed = _ManagedWork(_Sink(), work, 0)
    managed.get_future().then(lambda f: f.value() + 1)
    work.future.set_result(1)
    assert managed.wait() is True
    tail = managed.get_future().then(lambda f: f.value() * 10)
    assert tail.wait() == 20
    assert managed.is_completed()


def test_unsupported_future_api() -> None:
    fut = _ManagedWork(_Sink(), _ControlledWork(), 0).get_future()
    for call in (fut.value, fut.done, lambda: fut.set_result(1)):
        with pytest.raises(NotImplementedError):
            call()
    with pytest.raises(ValueError, match="tail"):
        head = fut
        head.then(lambda f: 1)
        head.then(lambda f: 2)


class _TimingSink(_Sink):
    """A sink that times the first continuation itself (``work.StepSink``), as the Manager."""

    def wrap_future_then(
        self,
        fut: torch.futures.Future[Any],
        then: Any,
        default: Any,
        timeout: timedelta | None = None,
        foreign: bool = False,
        expiry: Any = None,
    ) -> torch.futures.Future[Any]:
        return self.wrap_future(fut.then(then), default, timeout)

    def fail_step(self, e: Exception, how: str) -> None:
        self.errors.append(e)


def test_as_future_hands_on_a_pending_c10d_collective_without_waiting() -> None:
    # A c10d work's future is torch's C++ Future, not the Python subclass: it must be chained
    # on, not waited for on the caller's thread (DDP's comm hook would block in backward until
    # Gloo's timeout, which an abort for a lost peer does not shorten).
    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def build(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    tensor = torch.ones(3)
    work = groups[0].allreduce([tensor])
    assert not isinstance(work.get_future(), torch.futures.Future)  # the C++ class itself
    handed: list[torch.futures.Future[Any]] = []
    sink = _TimingSink()
    caller = threading.Thread(
        target=lambda: handed.append(_ManagedWork(sink, work, tensor, step=sink).as_future())
    )
    caller.start()
    caller.join(10)
    returned = not caller.is_alive()
    groups[1].allreduce([torch.ones(3)]).wait()  # rank 1 joins: the collective completes
    caller.join(30)
    assert returned, "as_future() waited for the collective on the caller's thread"
    handed[0].wait()
    assert torch.equal(tensor, torch.full((3,), 2.0))
