"""torchheal.futures: future_timeout, timed_then (and its Expiry), future_wait, context_timeout
and stream_timeout."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.futures import Future

from torchheal.futures import (
    _TIMEOUT_MANAGER,
    Expiry,
    _TimeoutManager,
    context_timeout,
    future_timeout,
    future_wait,
    stream_timeout,
    timed_then,
)


def test_future_wait_returns_value_and_raises() -> None:
    fut: Future[int] = Future()
    threading.Timer(0.01, lambda: fut.set_result(7)).start()
    assert future_wait(fut, timedelta(seconds=10)) == 7
    bad: Future[int] = Future()
    bad.set_exception(ValueError("nope"))
    with pytest.raises(ValueError, match="nope"):
        future_wait(bad, timedelta(seconds=1))


def test_future_wait_timeout() -> None:
    with pytest.raises(TimeoutError, match="future did not complete within"):
        future_wait(Future(), timedelta(milliseconds=10))


def test_future_timeout_passes_result_and_exception() -> None:
    fut: Future[int] = Future()
    out = future_timeout(fut, timedelta(seconds=10))
    fut.set_result(3)
    assert out.wait() == 3
    fut2: Future[int] = Future()
    out2 = future_timeout(fut2, timedelta(seconds=10))
    fut2.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        out2.wait()


def test_future_timeout_expires() -> None:
    fut: Future[int] = Future()
    out = future_timeout(fut, timedelta(milliseconds=10))
    with pytest.raises(TimeoutError, match=r"future did not complete within 0:00:00\.01"):
        out.wait()
    fut.set_result(1)  # a late result is ignored, not an error
    assert out.done()


def test_context_timeout_fires_and_cancels() -> None:
    fired = threading.Event()
    with context_timeout(fired.set, timedelta(milliseconds=10)):
        assert fired.wait(10)
    called: list[int] = []
    with context_timeout(lambda: called.append(1), timedelta(milliseconds=10)):
        pass
    # A later timer firing proves the manager passed the cancelled deadline without running it.
    sentinel = threading.Event()
    with context_timeout(sentinel.set, timedelta(milliseconds=50)):
        assert sentinel.wait(10)
    assert called == []


class _Event:
    """A recorded-event stand-in whose completion the test controls."""

    def __init__(self, complete: bool) -> None:
        self.complete = complete
        self.queried = threading.Event()

    def query(self) -> bool:
        self.queried.set()
        return self.complete


def test_stream_timeout_calls_back_only_when_late() -> None:
    late = threading.Event()
    event = _Event(complete=False)
    stream_timeout(late.set, timedelta(milliseconds=10), event=event)
    assert late.wait(10)
    ok_called = threading.Event()
    done = _Event(complete=True)
    stream_timeout(ok_called.set, timedelta(milliseconds=10), event=done)
    assert done.queried.wait(10)
    assert not ok_called.is_set()
    # Watched events are released on a caller's thread, on the next stream_timeout call.
    assert len(_TIMEOUT_MANAGER._del_queue) >= 1
    stream_timeout(lambda: None, timedelta(seconds=30), event=_Event(True)).cancel()
    assert len(_TIMEOUT_MANAGER._del_queue) == 0


def test_failing_callback_does_not_stop_manager() -> None:
    def _boom() -> None:
        raise RuntimeError("callback failure")

    with context_timeout(_boom, timedelta(milliseconds=1)):
        pass
    fired = threading.Event()
    with context_timeout(_boom, 0.001), context_timeout(fired.set, 0.005):
        assert fired.wait(10)


def test_watchdog_reports_stuck_callback() -> None:
    stuck = threading.Event()
    release = threading.Event()
    manager = _TimeoutManager(watchdog_timeout=0.1, on_stuck=stuck.set)
    manager.schedule(0.001, lambda: release.wait(30))
    try:
        assert stuck.wait(10), "a callback blocked past the watchdog timeout must be reported"
    finally:
        release.set()


def test_watchdog_quiet_for_short_callbacks() -> None:
    stuck = threading.Event()
    manager = _TimeoutManager(watchdog_timeout=0.2, on_stuck=stuck.set)
    done = threading.Event()
    for _ in range(5):
        manager.schedule(0.001, lambda: None)
    manager.schedule(0.5, done.set)
    assert done.wait(10)
    assert not stuck.is_set()


def test_timed_then_maps_outcome_once() -> None:
    calls: list[object] = []

    def swallow(f: Future[int]) -> int:
        calls.append(f)
        try:
            return f.value()
        except Exception:
            return -1

    fut: Future[int] = Future()
    out = timed_then(fut, timedelta(seconds=10), swallow)
    fut.set_result(3)
    assert out.wait() == 3
    failed: Future[int] = Future()
    out2 = timed_then(failed, timedelta(seconds=10), swallow)
    failed.set_exception(KeyError("k"))
    assert out2.wait() == -1
    assert len(calls) == 2


def test_timed_then_times_out_and_keeps_fn_errors() -> None:
    seen: list[BaseException] = []

    def record(f: Future[int]) -> int:
        try:
            return f.value()
        except Exception as e:
            seen.append(e)
            raise

    fut: Future[int] = Future()
    out = timed_then(fut, timedelta(milliseconds=10), record)
    with pytest.raises(TimeoutError, match=r"future did not complete within 0:00:00\.01"):
        out.wait()
    fut.set_result(1)  # late: fn is not called again
    assert len(seen) == 1 and isinstance(seen[0], TimeoutError)

    def boom(f: Future[int]) -> int:
        raise ValueError("from fn")

    src: Future[int] = Future()
    out2 = timed_then(src, timedelta(seconds=10), boom)
    src.set_result(0)
    with pytest.raises(ValueError, match="from fn"):
        out2.wait()


def test_an_expiry_ends_its_pending_futures_at_once_and_forgets_settled_ones() -> None:
    seen: list[BaseException | int] = []

    def record(f: Future[int]) -> int:
        try:
            value = f.value()
        except Exception as e:
            seen.append(e)
            return -1
        seen.append(value)
        return value

    expiry = Expiry()
    settled: Future[int] = Future()
    done = timed_then(settled, timedelta(seconds=60), record, expiry)
    settled.set_result(5)
    assert done.wait() == 5 and expiry.pending() == 0  # nothing kept for a settled one

    pending: Future[int] = Future()
    out = timed_then(pending, timedelta(seconds=60), record, expiry)
    assert expiry.pending() == 1 and not out.done()
    why = RuntimeError("dropped from quorum 3")
    assert expiry.expire(why) == 1
    assert out.wait() == -1 and seen[-1] is why and expiry.expired is why
    pending.set_result(1)  # late: fn is not called again
    assert len(seen) == 2
    assert expiry.expire(RuntimeError("again")) == 0  # once only

    # Registered after it expired: ends at once, with the same error.
    late: Future[int] = Future()
    assert timed_then(late, timedelta(seconds=60), record, expiry).wait() == -1
    assert seen[-1] is why
