"""The link's fallback for a reference lighthouse: its unary ``Heartbeat`` and ``Quorum`` calls.

A reference lighthouse serves no session; the link then speaks to it exactly as a torchft
manager would, and a dead group is noticed only when its heartbeat expires.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio

from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.group.dial import LinkError
from torchheal.coordination.rpc.errors import rpc_error_to_exception

__all__ = ["HEARTBEAT_CALL_TIMEOUT_S", "UnaryLink"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.link")

# How long a unary heartbeat may take; a lighthouse that slow is as good as unreachable.
HEARTBEAT_CALL_TIMEOUT_S = 2.0


class UnaryLink:
    """The unary half of :class:`~torchheal.coordination.group.link.LighthouseLink` (a mixin:
    its state is set by the link's constructor)."""

    async def _unary_quorum_call(self, requester: pb.QuorumMember, timeout_s: float) -> pb.Quorum:
        try:
            response = await asyncio.wait_for(
                self._unary_quorum(
                    pb.LighthouseQuorumRequest(requester=requester), timeout=timeout_s
                ),
                timeout_s,
            )
        except asyncio.TimeoutError:
            raise LinkError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:.3f}s", local=True
            ) from None
        except grpc.aio.AioRpcError as e:
            raise LinkError(e.code(), e.details() or "") from None
        if not response.HasField("quorum"):
            raise LinkError(grpc.StatusCode.INTERNAL, "lighthouse answered without a quorum")
        return response.quorum

    async def _run_unary_heartbeats(self) -> None:
        # The channel reconnects by itself after a lighthouse restart, so unlike the reference
        # there is no client to rebuild; we only report the outage once and its end once.
        request = pb.LighthouseHeartbeatRequest(replica_id=self._session.label)
        failing = False
        while not self._closing:
            try:
                await self._unary_heartbeat(request, timeout=HEARTBEAT_CALL_TIMEOUT_S)
                if failing:
                    logger.info("%s heartbeats to the lighthouse work again", self._prefix)
                    failing = False
            except grpc.aio.AioRpcError as e:
                if not failing:
                    logger.warning(
                        "%s heartbeat to lighthouse %s failed: %s",
                        self._prefix,
                        self._describe,
                        rpc_error_to_exception(e, "Heartbeat"),
                    )
                    failing = True
            await asyncio.sleep(self._interval_s)
