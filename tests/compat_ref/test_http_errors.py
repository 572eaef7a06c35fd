"""A failed HTTP receive is a ``CheckpointError`` and the reference's urllib error (issue 43):
``except URLError`` / ``except HTTPError`` written for the reference still catch."""

from __future__ import annotations

import socket
import urllib.error
from datetime import timedelta

import pytest
import torch

from torchheal.checkpointing import CheckpointError, CheckpointTimeoutError, HTTPTransport
from torchheal.checkpointing.http_transport_bench import main as bench_main

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def pair():
    src = HTTPTransport(TIMEOUT, 0, hostname="localhost")
    dst = HTTPTransport(TIMEOUT, 0, hostname="localhost")
    yield src, dst
    src.shutdown()
    dst.shutdown()


def test_refusal_is_an_http_error(pair) -> None:
    src, dst = pair
    src.send_checkpoint([1], 2345, {"x": torch.ones(1)}, TIMEOUT)
    with pytest.raises(urllib.error.HTTPError, match=r"Error 400.*serving 2345") as caught:
        dst.recv_checkpoint(0, src.metadata(), 1234, TIMEOUT)
    assert isinstance(caught.value, CheckpointError)
    assert caught.value.code == 400
    assert "serving 2345 but got step=1234" in caught.value.read().decode()


def test_zero_timeout_is_a_timeout_and_a_url_error(pair) -> None:
    src, dst = pair
    src.send_checkpoint([1], 1, {"x": torch.ones(1)}, TIMEOUT)
    with pytest.raises(urllib.error.URLError, match=r"urlopen error .*timed out") as caught:
        dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=0))
    assert isinstance(caught.value, CheckpointTimeoutError)
    assert isinstance(caught.value, TimeoutError)


def test_refused_connection_is_a_url_error(pair) -> None:
    _, dst = pair
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(urllib.error.URLError, match="urlopen error") as caught:
        dst.recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint/", 1, TIMEOUT)
    assert isinstance(caught.value, CheckpointError)
    assert not isinstance(caught.value, urllib.error.HTTPError)


def test_bench_module_runs(capsys: pytest.CaptureFixture[str]) -> None:
    bench_main(["--chunk-size=10", "--num-chunks=2", "--total-size=100", "--device=cpu"])
    assert "received 100 bytes in 10 tensors" in capsys.readouterr().out
