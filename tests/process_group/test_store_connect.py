"""A store connection to a host that refuses it (not started yet, or gone) is made as soon as the
host listens, ends within its timeout otherwise, and fills no log meanwhile (issue 9).

c10d's client alone tries a refused connection again and again, logging an error with a C++
stack at each try, and ends it at about twice its timeout (a random pause, then a second try of
the whole timeout): 4.0-5.5 s for a 2 s timeout here, 8 s for 3 s, 13 s for 5 s.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import DistNetworkError, TCPStore

from tests.process_group.helpers import on_thread
from torchheal.process_group.store import StoreConnectAbandoned, create_store_client

TIMEOUT = timedelta(seconds=3)
#: TIMEOUT plus slack for a loaded machine, well short of c10d's twice the timeout.
BOUND_S = 4.5


def closed_port() -> int:
    """A loopback port nothing listens on (the OS's free one, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("abandonable", [False, True], ids=["one-attempt", "attempts"])
def test_a_refused_connection_ends_with_its_timeout_and_logs_nothing(
    capfd: pytest.CaptureFixture[str], abandonable: bool
) -> None:
    port = closed_port()
    abandoned = threading.Event() if abandonable else None  # never set
    began = time.monotonic()
    with pytest.raises(DistNetworkError) as raised:
        create_store_client(f"127.0.0.1:{port}/q", TIMEOUT, abandoned=abandoned)
    took = time.monotonic() - began
    assert TIMEOUT.total_seconds() * 0.9 <= took < BOUND_S, f"ended after {took:.2f}s"
    assert f"no store at 127.0.0.1:{port} accepted a connection within 3s" in str(raised.value)
    assert "Connection refused" in str(raised.value)
    assert "[c10d]" not in capfd.readouterr().err, "c10d logged its tries"


def test_a_refused_connection_ends_at_once_when_abandoned() -> None:
    port = closed_port()
    abandoned = threading.Event()
    thread, outcome = on_thread(
        lambda: create_store_client(
            f"127.0.0.1:{port}/q", timedelta(seconds=60), abandoned=abandoned
        )
    )
    thread.join(0.3)
    assert thread.is_alive(), f"ended before it was abandoned: {outcome}"
    abandoned.set()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "still trying after it was abandoned"
    (error,) = outcome
    assert isinstance(error, StoreConnectAbandoned), error


@pytest.mark.parametrize("abandonable", [False, True], ids=["one-attempt", "attempts"])
def test_a_connection_begun_before_the_host_listens_is_made_once_it_does(
    capfd: pytest.CaptureFixture[str], abandonable: bool
) -> None:
    port = closed_port()
    abandoned = threading.Event() if abandonable else None
    made: list[object] = []
    thread, outcome = on_thread(
        lambda: made.append(
            create_store_client(f"127.0.0.1:{port}/q", timedelta(seconds=60), abandoned=abandoned)
        )
    )
    thread.join(0.3)
    assert thread.is_alive(), f"ended before the host listened: {outcome}"
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    thread.join(BOUND_S)
    assert not thread.is_alive(), "not connected after the host began to listen"
    assert outcome == [None], outcome
    (client,) = made
    client.set("k", "v")  # type: ignore[attr-defined]
    assert master.get("q/k") == b"v"
    assert client.timeout == timedelta(seconds=60)  # type: ignore[attr-defined]
    assert "[c10d]" not in capfd.readouterr().err, "c10d logged its tries"
