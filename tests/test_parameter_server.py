"""ParameterServer: sessions over HTTP, one fresh Gloo group each, isolation and bad requests."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from tests import warm
from torchheal.parameter_server import ParameterServer
from torchheal.process_group.base import ProcessGroup
from torchheal.process_group.gloo import ProcessGroupGloo

HOST = "127.0.0.1"


class AddServer(ParameterServer):
    """Receives the client's tensor, adds 23, sends it back; records how each session ended."""

    def __init__(self, **kwargs: object) -> None:
        self.finished: dict[str, str] = {}
        self.session_done = threading.Event()
        super().__init__(**kwargs)  # type: ignore[arg-type]

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        return ProcessGroupGloo(timeout=timedelta(seconds=10))

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        try:
            t = torch.zeros(3)
            pg.broadcast_one(t, root=1).wait()
            t += 23
            pg.broadcast_one(t, root=0).wait()
            self.finished[session_id] = "ok"
        except Exception as e:
            self.finished[session_id] = f"error: {e}"
            raise
        finally:
            self.session_done.set()


@pytest.fixture
def server() -> Iterator[AddServer]:
    srv = AddServer(port=0, hostname=HOST)
    yield srv
    srv.shutdown()


def _round_trip(address: str, token: str | None = None) -> torch.Tensor:
    pg = AddServer.new_session(address, token=token)
    try:
        t = torch.full((3,), 12.0)
        pg.broadcast_one(t, root=1).wait()
        pg.broadcast_one(t, root=0).wait()
        return t
    finally:
        pg.shutdown()


def test_client_sends_12_server_adds_23(server: AddServer) -> None:
    assert server.address().endswith("/new_session")
    out = _round_trip(server.address())
    torch.testing.assert_close(out, torch.full((3,), 35.0))


def test_each_session_gets_its_own_group(server: AddServer) -> None:
    for _ in range(2):
        server.session_done.clear()
        torch.testing.assert_close(_round_trip(server.address()), torch.full((3,), 35.0))
        assert server.session_done.wait(10)
    assert len(server.finished) == 2
    assert set(server.finished.values()) == {"ok"}


def _http(address: str, method: str = "GET", path: str | None = None) -> tuple[int, str]:
    url = address if path is None else address.rsplit("/", 1)[0] + path
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_malformed_requests_get_400_and_server_keeps_serving(server: AddServer) -> None:
    code, body = _http(server.address(), path="/bogus")
    assert code == 400
    assert "/new_session" in body
    code, body = _http(server.address(), method="POST")
    assert code == 400
    assert "unsupported method POST" in body

    # A request line that is not HTTP at all.
    port = int(server.address().rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(b"\x00\x01garbage\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n")[0]

    assert server.active_sessions() == 0
    torch.testing.assert_close(_round_trip(server.address()), torch.full((3,), 35.0))


def test_token_required_when_configured() -> None:
    srv = AddServer(port=0, hostname=HOST, token="s3cret")
    try:
        assert _http(srv.address())[0] == 401
        with pytest.raises(urllib.error.HTTPError) as info:
            AddServer.new_session(srv.address(), token="wrong")
        assert info.value.code == 403
        torch.testing.assert_close(
            _round_trip(srv.address(), token="s3cret"), torch.full((3,), 35.0)
        )
    finally:
        srv.shutdown()


def test_session_answer_is_json_with_session_store_address(server: AddServer) -> None:
    # Join a session by hand from the raw answer: the documented wire format is enough.
    with urllib.request.urlopen(server.address(), timeout=10) as resp:
        data = json.loads(resp.read())
    assert set(data) == {"session_id", "store_addr"}
    assert data["store_addr"] == f"{HOST}:{server.store_port()}/session/{data['session_id']}"
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(data["store_addr"], replica_id="1", rank=1, world_size=2)
    try:
        t = torch.full((3,), 1.0)
        pg.broadcast_one(t, root=1).wait()
        pg.broadcast_one(t, root=0).wait()
    finally:
        pg.shutdown()
    torch.testing.assert_close(t, torch.full((3,), 24.0))
    assert server.session_done.wait(10)
    assert server.finished == {data["session_id"]: "ok"}


def _dying_client(address: str, ready: multiprocessing.synchronize.Event) -> None:
    pg = AddServer.new_session(address)
    assert pg.size() == 2
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)  # dies with the session open, mid-protocol


def test_dead_client_ends_only_its_session(server: AddServer) -> None:
    ctx = warm.mp_context()
    ready = ctx.Event()
    proc = ctx.Process(target=_dying_client, args=(server.address(), ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(60), "client never configured its session"
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
        # The dead client's session fails within the group's timeout ...
        assert server.session_done.wait(30)
        (outcome,) = server.finished.values()
        assert outcome.startswith("error")
        # ... and the server still serves new clients.
        torch.testing.assert_close(_round_trip(server.address()), torch.full((3,), 35.0))
        assert sorted(server.finished.values())[1] == "ok"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
