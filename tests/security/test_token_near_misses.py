"""Every place a token is compared refuses tokens that are almost right.

The other security tests send tokens far from the real one, so a comparison that accepted any
prefix of the token (or the token with anything after it, or all but its last byte) would pass
them. Here each endpoint gets near misses: the token truncated by one byte, the token with a
byte appended, and the token with its first or its last byte changed, and then the token itself.
Real servers on loopback: the lighthouse's gRPC services (``TokenGuard``) and direct TCP lane,
the checkpoint HTTP server, and the dashboard's kill action and guarded ``/metrics``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc
import pytest
import torch

from tests.dashboard.helpers import http, lighthouse_with_dashboard
from tests.security.conftest import TOKEN
from tests.security.test_grpc import call
from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.checkpointing import CheckpointError, HTTPTransport
from torchheal.coordination import LighthouseServer
from torchheal.coordination.clients.direct_session import DirectSession, SessionBroken
from torchheal.coordination.rpc.auth import bearer_matches, token_matches

TIMEOUT = timedelta(seconds=10)


def _flip(c: str) -> str:
    return chr(ord(c) ^ 1)  # another printable character: a token may hold it


NEAR_MISSES = {
    "truncated": TOKEN[:-1],
    "suffixed": TOKEN + "x",
    "first-byte-changed": _flip(TOKEN[0]) + TOKEN[1:],
    "last-byte-changed": TOKEN[:-1] + _flip(TOKEN[-1]),
}


def test_the_comparison_itself_refuses_near_misses() -> None:
    for name, given in NEAR_MISSES.items():
        assert not token_matches(given, TOKEN), name
        assert not bearer_matches(f"Bearer {given}", TOKEN), name
    assert token_matches(TOKEN, TOKEN)
    assert bearer_matches(f"bearer  {TOKEN} ", TOKEN)  # the scheme's case and blanks: HTTP's
    assert not bearer_matches(f"Basic {TOKEN}", TOKEN)


@pytest.fixture
def lighthouse(job_env: Any) -> Iterator[LighthouseServer]:
    job_env()
    server = LighthouseServer("127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000)
    yield server
    server.shutdown()


def test_the_lighthouse_grpc_services_refuse_near_misses(lighthouse: LighthouseServer) -> None:
    addr = f"127.0.0.1:{lighthouse.port()}"
    heartbeat = pb.LighthouseHeartbeatRequest(replica_id="intruder")
    for name, given in NEAR_MISSES.items():
        answer = call(addr, methods.LIGHTHOUSE_HEARTBEAT, heartbeat, [_auth(given)])
        assert answer == grpc.StatusCode.UNAUTHENTICATED, name
    assert lighthouse.status()["heartbeats"] == {}
    answer = call(addr, methods.LIGHTHOUSE_HEARTBEAT, heartbeat, [_auth(TOKEN)])
    assert answer == pb.LighthouseHeartbeatResponse()


def test_the_lighthouse_direct_lane_refuses_near_misses(lighthouse: LighthouseServer) -> None:
    port = lighthouse.direct_port()
    for name, given in NEAR_MISSES.items():
        with pytest.raises(SessionBroken, match="job token"):
            DirectSession("127.0.0.1", port, name, 5, SecurityEnv(token=given))
    DirectSession("127.0.0.1", port, "right", 5, SecurityEnv(token=TOKEN)).close()


def test_the_checkpoint_server_refuses_near_misses(job_env: Any) -> None:
    job_env(token=None)
    src = HTTPTransport(TIMEOUT, num_chunks=0, token=TOKEN)
    try:
        src.send_checkpoint([1], 3, {"w": torch.arange(4.0)}, TIMEOUT)
        for given in NEAR_MISSES.values():
            dst = HTTPTransport(TIMEOUT, num_chunks=0, token=given)
            try:
                with pytest.raises(CheckpointError, match="401"):
                    dst.recv_checkpoint(0, src.metadata(), 3)
            finally:
                dst.shutdown()
        dst = HTTPTransport(TIMEOUT, num_chunks=0, token=TOKEN)
        try:
            assert torch.equal(dst.recv_checkpoint(0, src.metadata(), 3)["w"], torch.arange(4.0))
        finally:
            dst.shutdown()
    finally:
        src.shutdown()


def test_the_dashboard_refuses_near_misses(job_env: Any) -> None:
    job_env(token=None)
    kills: list[str] = []
    dashboard = {"token": TOKEN, "metrics_auth": True, "kill": lambda a, m: kills.append(a)}
    with lighthouse_with_dashboard(1, dashboard=dashboard) as (_, _, url):
        # No group is in the quorum: a kill let through answers 404, a refused one 401.
        kill = url + "api/replicas/g0/kill"
        for name, given in NEAR_MISSES.items():
            headers = {"Authorization": f"Bearer {given}"}
            status, _, body = http(kill, method="POST", headers=headers)
            assert (status, json.loads(body)["error"]) == (401, "refused: wrong job token"), name
            assert http(url + "metrics", headers=headers)[0] == 401, name
        right = {"Authorization": f"Bearer {TOKEN}"}
        assert http(kill, method="POST", headers=right)[0] == 404
        assert http(url + "metrics", headers=right)[0] == 200
        assert kills == []


def _auth(token: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {token}")
