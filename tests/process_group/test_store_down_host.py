"""A process group's store connection whose host refuses it (down, or not listening yet) waits
for it quietly after the first attempt, and ends at its timeout.

A group's build connects in attempts of a second, so that it can be abandoned. c10d's client
logs every attempt that finds nothing listening with a C++ stack, and tries again after a
random pause of up to two seconds, so the connection ended seconds after its timeout. These
tests run the client against a port with no listener (a socket bound but not listening
refuses), read what the process wrote to its stderr, and let the same socket listen later for
a host that comes back.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import Store, TCPStore

from tests.process_group.helpers import on_thread
from torchheal.process_group.store import StoreConnectAbandoned, create_store_client

#: Past the first attempt: a second, and c10d's pause of up to 2 s.
TIMEOUT = timedelta(seconds=5)
#: A timeout the first attempt may outlast: its failure is reported as the connection's.
SHORT = timedelta(seconds=2)
#: Slack for a loaded machine.
SLACK_S = 2.0
BOUND_S = TIMEOUT.total_seconds() + SLACK_S
#: What c10d logs for each try of a refused connection (two per attempt).
C10D_TRY = "TCP client failed to connect"
#: What it logs when it gives an attempt up; not always, but always the socket's timeout of
#: each of the attempt's two tries (a line of its own, from socket.cpp).
C10D_GAVE_UP = "timed out (try=1"
C10D_SOCKET_TIMEOUT = "socket.cpp"


@pytest.fixture
def refusing_port() -> Iterator[socket.socket]:
    """A bound socket that does not listen yet: connections to its port are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


def connect_on_thread(
    port: int, timeout: timedelta, abandoned: threading.Event
) -> tuple[threading.Thread, list[BaseException | None], list[Store]]:
    clients: list[Store] = []
    thread, outcome = on_thread(
        lambda: clients.append(
            create_store_client(f"127.0.0.1:{port}/q", timeout, abandoned=abandoned)
        )
    )
    return thread, outcome, clients


def tries_timed_out(err: str) -> int:
    return sum(C10D_SOCKET_TIMEOUT in line and "timed out" in line for line in err.splitlines())


def first_attempt_failed(capfd: pytest.CaptureFixture[str], thread: threading.Thread) -> str:
    """Waits until c10d has given up the first attempt (its log says so); returns the log."""
    err = ""
    deadline = time.monotonic() + BOUND_S
    while C10D_GAVE_UP not in err and tries_timed_out(err) < 2:
        assert time.monotonic() < deadline, f"no attempt failed within {BOUND_S}s: {err!r}"
        assert thread.is_alive(), "the connection ended with its first attempt"
        thread.join(0.05)
        err += capfd.readouterr().err
    return err


@pytest.mark.parametrize("timeout", [TIMEOUT, SHORT], ids=["5s", "2s"])
def test_a_connection_to_a_down_store_host_ends_at_its_timeout_after_one_logged_attempt(
    refusing_port: socket.socket, timeout: timedelta, capfd: pytest.CaptureFixture[str]
) -> None:
    port = refusing_port.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        create_store_client(f"127.0.0.1:{port}/q", timeout, abandoned=threading.Event())
    took = time.monotonic() - began
    seconds = timeout.total_seconds()
    assert seconds * 0.9 <= took <= seconds + SLACK_S, f"ended after {took:.2f}s"
    message = str(raised.value)
    assert message.startswith(
        f"no connection to the store at 127.0.0.1:{port} within the connection's timeout "
        f"({seconds:g}s): "
    ), message
    if timeout == TIMEOUT:
        assert "refused" in message.lower(), message
    assert "frame #" not in message, "c10d's C++ stack came along"
    # Only this port's: an attempt abandoned by an earlier test may still log to this process's
    # stderr.
    tries = sum(
        C10D_TRY in line and f"127.0.0.1:{port} " in line
        for line in capfd.readouterr().err.splitlines()
    )
    assert tries <= 2, f"c10d logged {tries} tries: one attempt's are 2"


def test_a_store_host_back_after_a_failed_attempt_is_connected_to(
    refusing_port: socket.socket, capfd: pytest.CaptureFixture[str]
) -> None:
    port = refusing_port.getsockname()[1]
    thread, outcome, clients = connect_on_thread(port, timedelta(seconds=30), threading.Event())
    first_attempt_failed(capfd, thread)
    refusing_port.listen(16)
    host = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
        master_listen_fd=refusing_port.detach(),  # the store host owns it from now on
    )
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"not connected {BOUND_S}s after the host listened"
    assert outcome == [None], outcome
    (client,) = clients
    client.set("k", "v")
    assert host.get("q/k") == b"v"
    assert client.timeout == timedelta(seconds=30)  # its operations keep the whole timeout


def test_a_connection_waiting_for_a_down_store_host_ends_once_abandoned(
    refusing_port: socket.socket, capfd: pytest.CaptureFixture[str]
) -> None:
    port = refusing_port.getsockname()[1]
    abandoned = threading.Event()
    thread, outcome, _clients = connect_on_thread(port, timedelta(seconds=60), abandoned)
    first_attempt_failed(capfd, thread)
    abandoned.set()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"still connecting {BOUND_S}s after it was given up"
    (error,) = outcome
    assert isinstance(error, StoreConnectAbandoned), error
