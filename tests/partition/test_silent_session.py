"""A group's lighthouse session that goes silent is hung up and reopened.

A partition drops packets without a FIN or RST, and after a long one each side's TCP
retransmissions are backed off so far that the old connection may stay mute for as long again
after the network is back. The link must not wait on it: once the lighthouse has said nothing
for its silence limit, the request in flight fails as "the session broke" (the manager server
asks again) and the session is reopened on a fresh connection as soon as one gets through.

A real lighthouse, reached through a proxy that stalls (``bench/_chaos_proxy.py``: it stops
moving bytes both ways and keeps every connection open), and a real ``LighthouseLink`` on its
own event loop.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from bench._chaos_proxy import StallingProxy
from torchheal._base.security import SecurityEnv
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import LighthouseServer
from torchheal.coordination.group.dial import LinkError
from torchheal.coordination.group.link import LighthouseLink
from torchheal.coordination.rpc.channels import aio_connect

pytestmark = pytest.mark.timeout(120)

#: The link's silence limit in this test (the default is the reference's heartbeat timeout).
SILENT_S = 1.0
#: How long a request may wait in the test before it counts as hung.
BOUND_S = 20.0


def _member(replica_id: str, step: int) -> pb.QuorumMember:
    return pb.QuorumMember(replica_id=replica_id, address="a", store_address="s", step=step)


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _scenario(lighthouse: LighthouseServer, proxy: StallingProxy) -> None:
    grpc_port = lighthouse.port()
    target = f"http://{proxy.host}:{grpc_port}"
    channel = await aio_connect(target, 10.0, SecurityEnv())
    link = LighthouseLink(
        channel,
        "g:1",
        0.05,
        lambda lost: None,
        target,
        "[g]",
        host=proxy.host,
        silent_s=SILENT_S,
        security=SecurityEnv(),
    )
    try:
        await link.start()
        assert link.session_mode and link.direct, "the session should take the direct lane"
        runner = asyncio.ensure_future(link.run())
        first = await asyncio.wait_for(link.quorum(_member("g:1", 0), 10.0), BOUND_S)
        assert [m.replica_id for m in first.participants] == ["g:1"]

        proxy.stall()
        # Asked while the path is stalled: the request can neither arrive nor be answered.
        started = time.monotonic()
        with pytest.raises(LinkError) as broke:
            await asyncio.wait_for(link.quorum(_member("g:1", 1), 60.0), BOUND_S)
        assert broke.value.code == grpc.StatusCode.UNAVAILABLE, broke.value
        assert "session broke" in broke.value.details, broke.value
        print(f"the silent session was given up after {time.monotonic() - started:.1f}s")

        proxy.resume()
        await _until(lambda: link._call is not None, "the session to be reopened")
        again = await asyncio.wait_for(link.quorum(_member("g:1", 1), 10.0), BOUND_S)
        assert [m.replica_id for m in again.participants] == ["g:1"]
        runner.cancel()
    finally:
        await link.close()
        await channel.close()


def test_a_silent_session_is_reopened_and_the_request_asked_again() -> None:
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=5000
    )
    try:
        grpc_port = lighthouse.port()
        proxy = StallingProxy("127.0.0.3", "127.0.0.1", [grpc_port, lighthouse.direct_port()])
        try:
            asyncio.run(_scenario(lighthouse, proxy))
        finally:
            proxy.close()
    finally:
        lighthouse.shutdown()
