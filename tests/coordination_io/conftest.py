"""Fixtures: lighthouse and manager servers on loopback, port 0, shut down after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from torchheal.coordination import LighthouseServer, ManagerServer


@pytest.fixture
def make_lighthouse() -> Iterator[Callable[..., LighthouseServer]]:
    servers: list[LighthouseServer] = []

    def make(min_replicas: int = 1, **kwargs: Any) -> LighthouseServer:
        server = LighthouseServer("127.0.0.1:0", min_replicas=min_replicas, **kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()


@pytest.fixture
def make_manager() -> Iterator[Callable[..., ManagerServer]]:
    servers: list[ManagerServer] = []

    def make(
        lighthouse_addr: str,
        replica_id: str = "rep:uuid",
        world_size: int = 1,
        store_addr: str = "store:1234",
        quorum_retries: int = 0,
        connect_timeout: timedelta = timedelta(seconds=5),
    ) -> ManagerServer:
        server = ManagerServer(
            replica_id=replica_id,
            lighthouse_addr=lighthouse_addr,
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr=store_addr,
            world_size=world_size,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=connect_timeout,
            quorum_retries=quorum_retries,
        )
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()
