"""Settings built at an edge and passed down win over the environment (issue 42).

Each public constructor given ``security=`` uses exactly those settings, on every lane it
opens, even when the process's environment says otherwise: a command's ``--token-file`` and
``--tls-*`` flags never reach its own environment, so a read of it deep in the I/O code would
serve or call with the wrong token.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from tests.coordination_io.helpers import wait_until
from tests.security.conftest import TOKEN
from torchheal._base.security import SecurityEnv
from torchheal.checkpointing.http_transport import HTTPTransport
from torchheal.coordination import LighthouseClient, LighthouseServer, ManagerClient, ManagerServer
from torchheal.coordination.group import server as manager_server_module
from torchheal.coordination.lighthouse.dashboard.server import kill_replica

SETTINGS = SecurityEnv(token=TOKEN)
TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def conflicting_env(job_env: Any) -> None:
    job_env(token="the-environments-other-token")


@pytest.fixture
def lighthouse(conflicting_env: None) -> Iterator[LighthouseServer]:
    server = LighthouseServer("127.0.0.1:0", min_replicas=1, security=SETTINGS)
    yield server
    server.shutdown()


def test_lighthouse_and_client_use_the_settings_they_are_given(
    lighthouse: LighthouseServer,
) -> None:
    addr = f"127.0.0.1:{lighthouse.port()}"
    client = LighthouseClient(addr, TIMEOUT, security=SETTINGS)
    try:
        assert client.direct  # Describe and the direct lane's hello were let in
        client.heartbeat("g0")
        assert "g0" in lighthouse.status()["heartbeats"]
    finally:
        client.close()
    # A client left to read the environment sends the other token and is refused.
    stranger = LighthouseClient(addr, TIMEOUT)
    try:
        with pytest.raises(RuntimeError, match=r"(?i)unauthenticated"):
            stranger.heartbeat("g1")
    finally:
        stranger.close()
    assert "g1" not in lighthouse.status()["heartbeats"]


def test_manager_server_client_and_kill_use_the_settings_they_are_given(
    conflicting_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An open lighthouse, gRPC lane only: the server's own link is let in whatever it sends;
    # what is under test is the server's own endpoint.
    lighthouse = LighthouseServer(
        "127.0.0.1:0", min_replicas=1, direct_port=None, security=SecurityEnv()
    )
    server = ManagerServer(
        replica_id="g0",
        lighthouse_addr=f"http://127.0.0.1:{lighthouse.port()}",
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="s:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=10),
        security=SETTINGS,
    )
    exits: list[int] = []
    monkeypatch.setattr(manager_server_module.os, "_exit", exits.append)
    try:
        addr = server.address()
        stranger = ManagerClient(addr, TIMEOUT)  # the environment's token: refused
        try:
            with pytest.raises(RuntimeError, match=r"(?i)unauthenticated"):
                stranger.kill("no", timeout=TIMEOUT)
        finally:
            stranger.close()
        kill_replica(addr, "bye", security=SETTINGS)
        wait_until(lambda: exits, 5, "the kill's exit")
        assert exits == [1]
    finally:
        server.shutdown()
        lighthouse.shutdown()


def test_http_transport_takes_its_token_from_the_settings(conflicting_env: None) -> None:
    transport: HTTPTransport[Any] = HTTPTransport(TIMEOUT, 0, security=SETTINGS)
    try:
        assert transport._token == TOKEN
    finally:
        transport.shutdown()
    own = SecurityEnv(token=TOKEN, checkpoint_token="transport-only")
    transport = HTTPTransport(TIMEOUT, 0, security=own)
    try:
        assert transport._token == "transport-only"
    finally:
        transport.shutdown()
