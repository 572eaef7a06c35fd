"""The blocking client of the lighthouse, for tools and tests that talk to it directly.

Every call carries its own deadline; failures map as in the reference: deadline or cancellation
-> ``TimeoutError``, anything else -> ``RuntimeError``
(:class:`~torchheal.coordination.rpc.errors.RPCError`). Safe to share between threads.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import grpc

from torchheal._base.security import SecurityEnv
from torchheal._base.timeouts import to_seconds
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.clients.direct_session import (
    DirectSession,
    Refused,
    SessionBroken,
    heartbeat_request,
    issued_quorum,
    quorum_request,
)
from torchheal.coordination.rpc.addresses import parse_address
from torchheal.coordination.rpc.channels import UnaryCaller, connect
from torchheal.coordination.rpc.errors import RPCError, status_error
from torchheal.coordination.types import Quorum

__all__ = ["LighthouseClient"]

logger: logging.Logger = logging.getLogger(__name__)

# One round trip each on a working network: an unreachable lane must not hold a client up long.
DESCRIBE_TIMEOUT_S = 5.0
DIRECT_CONNECT_TIMEOUT_S = 5.0
# How much longer than a call's timeout a client waits for the lighthouse's own answer.
LOCAL_TIMEOUT_GRACE_S = 0.25


class LighthouseClient:
    """Client of the lighthouse, for tools and tests that talk to it directly.

    With a torchheal lighthouse, calls travel on one *detached* session over its direct TCP lane
    (it speaks for no group, so closing it declares nobody dead); a reference lighthouse or an
    unreachable lane gets the reference's unary calls. Results and errors are the reference's,
    but a quorum request that times out is withdrawn at once, so no quorum includes a requester
    nobody waits for.

    Args:
        addr: the lighthouse address, ``http://host:port`` or ``host:port``.
        connect_timeout: how long to keep trying to connect before raising.
        security: job token and TLS settings (torchheal's; None: read from the environment).

    Raises:
        ValueError: ``addr`` or the security settings are malformed.
        RuntimeError: the lighthouse could not be reached within ``connect_timeout``.
    """

    def __init__(
        self, addr: str, connect_timeout: timedelta, *, security: SecurityEnv | None = None
    ) -> None:
        self._addr = addr
        started = time.monotonic()
        self._security = SecurityEnv.from_env() if security is None else security
        self._channel = connect(addr, connect_timeout, self._security)
        self._quorum = UnaryCaller(self._channel, methods.LIGHTHOUSE_QUORUM, addr)
        self._heartbeat = UnaryCaller(self._channel, methods.LIGHTHOUSE_HEARTBEAT, addr)
        self._quorum_what = f"LighthouseService/Quorum to {addr}"
        self._heartbeat_what = f"LighthouseService/Heartbeat to {addr}"
        self._connect_s = to_seconds(connect_timeout)
        self._host = parse_address(addr)[0]
        self._lock = threading.Lock()
        self._session: DirectSession | None = None
        self._closed = False
        remaining = max(0.1, self._connect_s - (time.monotonic() - started))
        self._direct_port = _direct_port(self._channel, addr, min(remaining, DESCRIBE_TIMEOUT_S))

    @property
    def direct(self) -> bool:
        """Whether calls go over the lighthouse's direct session lane (False: unary gRPC)."""
        return self._direct_port != 0

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: dict[str, Any] | None = None,
    ) -> Quorum:
        """Ask to join the next quorum and wait for it (fields as in :class:`QuorumMember`).

        Raises:
            TimeoutError: no quorum including this replica was issued within ``timeout``.
            RuntimeError: the lighthouse rejected the request or could not be reached.
            TypeError: ``data`` is not a JSON-serialisable dict.
        """
        wire_data = convert.data_to_wire(data)
        session = self._open_session()
        if session is None:
            member = pb.QuorumMember(
                replica_id=replica_id,
                address=address,
                store_address=store_address,
                step=step,
                world_size=world_size,
                shrink_only=shrink_only,
                data=wire_data,
            )
            response = self._quorum(pb.LighthouseQuorumRequest(requester=member), timeout)
            if not response.HasField("quorum"):
                raise RuntimeError(f"lighthouse {self._addr} answered without a quorum")
            return convert.quorum_from_pb(response.quorum, strict_data=False)
        timeout_s = to_seconds(timeout)
        request_id = session.next_id()
        request = quorum_request(
            request_id,
            replica_id,
            address,
            store_address,
            step,
            world_size,
            shrink_only,
            wire_data,
            max(1, math.ceil(timeout_s * 1000)),
        )
        event = self._call(session, request_id, request, timeout_s, self._quorum_what)
        issued = issued_quorum(event)
        if issued is not None:
            return _decode_quorum(issued[1])
        parsed = spb.SessionEvent.FromString(event)
        return _decode_quorum(parsed.quorum.quorum.SerializeToString())

    def heartbeat(self, replica_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Tell the lighthouse this replica is alive; returns once the lighthouse recorded it.

        ``TimeoutError`` with no answer within ``timeout``; else ``RuntimeError`` on failure.
        """
        session = self._open_session()
        if session is None:
            self._heartbeat(pb.LighthouseHeartbeatRequest(replica_id=replica_id), timeout)
            return
        ack = session.next_id()
        self._call(
            session,
            ack,
            heartbeat_request(replica_id, ack),
            to_seconds(timeout),
            self._heartbeat_what,
        )

    def close(self) -> None:
        """Close the connection; later calls fail with ``RuntimeError``."""
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            session.close()
        self._channel.close()

    # ------------------------------------------------------------------------------------------

    def _open_session(self) -> DirectSession | None:
        """The live direct session (opened, or reopened after a break); None: use unary."""
        if not self._direct_port:
            return None
        session = self._session
        if session is not None and not session.broken:
            return session
        with self._lock:
            if self._closed:
                raise RuntimeError(f"LighthouseClient of {self._addr} is closed")
            session = self._session
            if session is not None and not session.broken:
                return session
            try:
                session = DirectSession(
                    self._host,
                    self._direct_port,
                    f"client:{socket.gethostname()}:{os.getpid()}",
                    min(self._connect_s, DIRECT_CONNECT_TIMEOUT_S),
                    self._security,
                )
            except (OSError, SessionBroken) as e:
                # A lane the network does not let through: the gRPC port works, so use unary.
                logger.warning(
                    "lighthouse %s: its direct session lane (port %d) cannot be reached (%s); "
                    "using unary gRPC calls",
                    self._addr,
                    self._direct_port,
                    e,
                )
                self._direct_port = 0
                return None
            self._session = session
            return session

    def _call(
        self, session: DirectSession, request_id: int, request: bytes, timeout_s: float, what: str
    ) -> bytes:
        try:
            # The lighthouse answers a request that timed out itself; our own limit, a little
            # later, only covers a lighthouse that does not answer at all.
            answer = session.call(request_id, request, timeout_s + LOCAL_TIMEOUT_GRACE_S)
        except TimeoutError:
            raise TimeoutError(
                f'{what} failed: status: Cancelled, message: "Timeout expired" '
                f"(no answer within {timeout_s:g}s)"
            ) from None
        except SessionBroken as e:
            raise status_error(what, grpc.StatusCode.UNAVAILABLE, str(e)) from None
        if isinstance(answer, Refused):
            if answer.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise TimeoutError(
                    f'{what} failed: status: Cancelled, message: "Timeout expired" '
                    f"({answer.message})"
                )
            raise status_error(what, answer.code, answer.message)
        return answer


def _direct_port(channel: grpc.Channel, addr: str, timeout_s: float) -> int:
    """The lighthouse's direct session port; 0 for a reference lighthouse (or none)."""
    describe = UnaryCaller(channel, methods.LIGHTHOUSE_DESCRIBE, addr)
    try:
        return describe(spb.DescribeRequest(), timeout_s).session_port
    except RPCError as e:
        if e.code != grpc.StatusCode.UNIMPLEMENTED:
            logger.info("lighthouse %s: Describe failed (%s); using unary gRPC calls", addr, e)
        return 0
    except TimeoutError:
        logger.info("lighthouse %s: Describe timed out; using unary gRPC calls", addr)
        return 0


# Several clients in one process (simulations of many groups) receive the same quorum bytes:
# keep the last decoded. Only quorums without member data are shared (the rest is immutable).
_last_decoded: tuple[bytes, Quorum] | None = None


def _decode_quorum(data: bytes) -> Quorum:
    global _last_decoded
    last = _last_decoded
    if last is not None and last[0] == data:
        return last[1]
    # Lenient: one peer's odd data must not make the whole quorum unusable.
    quorum = convert.quorum_from_pb(pb.Quorum.FromString(data), strict_data=False)
    if all(m.data is None for m in quorum.participants):
        _last_decoded = (data, quorum)
    return quorum
