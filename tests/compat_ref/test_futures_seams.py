"""The timeout manager's watchdog as the reference's tests reach it (issue 43): its limit as
``_watchdog_interval`` (a timedelta), and the exit of a stuck process through ``sys.exit``."""

from __future__ import annotations

from datetime import timedelta

import pytest

from torchheal import futures
from torchheal.futures import _TimeoutManager


def test_watchdog_interval_reads_and_sets_the_limit() -> None:
    manager = _TimeoutManager(watchdog_timeout=30.0)
    assert manager._watchdog_interval == timedelta(seconds=30)
    manager._watchdog_interval = timedelta(milliseconds=1500)
    assert manager._watchdog_timeout == 1.5


def test_stuck_exit_goes_through_a_replaced_sys_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    codes: list[object] = []
    hard: list[int] = []
    monkeypatch.setattr(futures.sys, "exit", codes.append)
    monkeypatch.setattr(futures.os, "_exit", hard.append)
    futures._exit_stuck()
    assert codes == [1]
    assert hard == []  # whoever replaced sys.exit decides


def test_stuck_exit_ends_the_process_from_any_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    hard: list[int] = []
    monkeypatch.setattr(futures.os, "_exit", hard.append)
    futures._exit_stuck()  # the real sys.exit raises SystemExit, which alone ends a thread only
    assert hard == [1]
