"""torchheal.multiprocessing._MonitoredPipe: timeouts, error passing, EOF and closed handles."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest

from torchheal.multiprocessing import _MonitoredPipe


def test_send_recv_and_exception_passing() -> None:
    a, b = mp.Pipe()
    left, right = _MonitoredPipe(a), _MonitoredPipe(b)
    left.send({"x": 1})
    assert right.recv(timeout=timedelta(seconds=5)) == {"x": 1}
    left.send(ValueError("from peer"))
    with pytest.raises(ValueError, match="from peer"):
        right.recv(timeout=5)


def test_recv_timeout() -> None:
    a, _b = mp.Pipe()
    with pytest.raises(TimeoutError, match=r"pipe.recv\(\) timed out after 0\.01 seconds"):
        _MonitoredPipe(a).recv(timeout=timedelta(milliseconds=10))


def test_eof_when_peer_closes() -> None:
    a, b = mp.Pipe()
    left, right = _MonitoredPipe(a), _MonitoredPipe(b)
    left.close()
    assert left.closed()
    with pytest.raises(EOFError):
        right.recv(timeout=5)


def test_broken_pipe_and_closed_handle() -> None:
    a, b = mp.Pipe()
    left, right = _MonitoredPipe(a), _MonitoredPipe(b)
    right.close()
    with pytest.raises(BrokenPipeError):
        left.send("x")
    left.close()
    with pytest.raises(OSError, match="handle is closed"):
        left.send("x")
