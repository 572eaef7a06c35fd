"""The lighthouse server: gRPC (and a direct TCP lane) around the pure quorum decision.

This module wires ``rounds.py``, ``notices.py`` and ``session.py``/``tcp.py`` to the servers,
serves the reference's unary ``Heartbeat``/``Quorum`` and ``Describe``, runs the tick, and offers
the public API. An optional :class:`LighthouseObserver` lets dashboards and metrics build on top
without this module importing them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc
import grpc.aio

from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.lighthouse.answers import Issued
from torchheal.coordination.lighthouse.notices import SessionRegistry
from torchheal.coordination.lighthouse.rounds import QuorumRounds, Waiter
from torchheal.coordination.lighthouse.session import (
    Peer,
    check_replica_id,
    session_handler,
    validated_member,
)
from torchheal.coordination.lighthouse.store import QuorumStore, StoreError
from torchheal.coordination.lighthouse.tcp import DirectLane
from torchheal.coordination.quorum import LighthouseConfig
from torchheal.coordination.rpc.addresses import format_target, parse_address
from torchheal.coordination.rpc.errors import StatusError
from torchheal.coordination.rpc.server import SERVER_OPTIONS, AioServerThread, unary_handler
from torchheal.coordination.types import Quorum, QuorumMember

__all__ = ["LighthouseObserver", "LighthouseServer"]

logger: logging.Logger = logging.getLogger(__name__)

# Python API defaults (reference §2.4); the CLI has its own (join timeout 60 s).
DEFAULT_JOIN_TIMEOUT_MS = 100
DEFAULT_QUORUM_TICK_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5000


class LighthouseObserver(Protocol):
    """What the lighthouse tells an observer (a dashboard, metrics). All optional to act on.

    Every method is called on the lighthouse's event-loop thread, some under its state lock, so
    an observer must be quick, must not block and must not call back into the lighthouse. Times
    are ``time.monotonic()`` seconds. Exceptions are logged and otherwise ignored.

    Args:
        replica_id: (of the methods) the replica group's full id.
        round_s: seconds from the round's first request to the issued quorum.
        last_seen: when the expired replica's last heartbeat arrived.
        now: when the lighthouse saw the event.
    """

    def heartbeat(self, replica_id: str) -> None:
        """A heartbeat arrived (the hottest path: count it, do nothing more)."""

    def joined(self, member: QuorumMember, now: float) -> None:
        """A quorum request arrived and joined the round."""

    def quorum_issued(self, quorum: Quorum, reason: str, round_s: float, now: float) -> None:
        """A quorum was issued; ``round_s`` is the time since the round's first request."""

    def expired(self, replica_id: str, last_seen: float, now: float) -> None:
        """A replica's last heartbeat became older than the heartbeat timeout."""

    def reason_changed(self, reason: str, now: float) -> None:
        """The quorum status (the reason string of the latest decision) changed."""

    def lost(self, replica_id: str, reason: str, now: float) -> None:
        """A member of the current quorum is gone (``reason``: why the lighthouse knows)."""


class LighthouseServer:
    """The job's lighthouse: decides which replica groups form each step's quorum.

    Starts serving in the constructor, on a background thread with its own event loop.

    Args:
        bind: address to listen on, e.g. ``"[::]:29510"``; port 0 picks a free port.
        min_replicas: fewest replica groups a new quorum may have (>= 1).
        join_timeout_ms: how long to wait for heartbeating replicas that have not asked to
            join before issuing a quorum without them (None: 100).
        quorum_tick_ms: how often to re-evaluate waiting requests (None: 100).
        heartbeat_timeout_ms: a replica silent this long is gone (None: 5000).
        observer: a :class:`LighthouseObserver`, or None.
        direct_port: TCP port of the direct session lane on ``bind``'s host (0: any free
            port; None: no lane, sessions use the gRPC stream).
        store: where the last issued quorum is kept across restarts (a file, etcd), restored
            before serving; None: nowhere.
        security: job token and TLS settings of both lanes (None: from the environment).

    Raises:
        ValueError: an option is out of range or ``bind`` is malformed.
        RuntimeError: the address could not be bound.
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        observer: LighthouseObserver | None = None,
        direct_port: int | None = 0,
        store: QuorumStore | None = None,
        security: SecurityEnv | None = None,
    ) -> None:
        # A public constructor is an edge: the settings are built here, then only passed on.
        security = SecurityEnv.from_env() if security is None else security
        self._observer = observer
        self._config = LighthouseConfig(
            min_replicas=min_replicas,
            join_timeout_ms=DEFAULT_JOIN_TIMEOUT_MS if join_timeout_ms is None else join_timeout_ms,
            quorum_tick_ms=DEFAULT_QUORUM_TICK_MS if quorum_tick_ms is None else quorum_tick_ms,
            heartbeat_timeout_ms=(
                DEFAULT_HEARTBEAT_TIMEOUT_MS
                if heartbeat_timeout_ms is None
                else heartbeat_timeout_ms
            ),
        )
        self._config.validate()
        if direct_port is not None and not 0 <= direct_port <= 65535:
            raise ValueError(f"direct_port must be in [0, 65535] or None, got {direct_port!r}")
        host, _ = parse_address(bind)
        observed = observer is not None
        try:
            self._rounds = QuorumRounds(self._config, self._notify, observed, store)
        except StoreError as e:
            raise RuntimeError(f"lighthouse: {e}") from e
        self._sessions = SessionRegistry(self._rounds, self._notify, observed)
        self._rounds.on_issued = self._sessions.on_issued
        # The state and its lock, under the names tests and tools have read them by.
        self._state = self._rounds.state
        self._lock = self._rounds.lock
        # Keep-alive ends a connection silent without a FIN within about the heartbeat timeout,
        # never sooner: a session must not declare a group gone before its heartbeats would.
        keepalive_ms = max(1000, self._config.heartbeat_timeout_ms // 2)
        self._lane = DirectLane(self, self._config.heartbeat_timeout_ms / 1000.0, security)
        self._created_at = time.monotonic()
        self._server = AioServerThread(
            "torchheal-lighthouse",
            bind,
            {
                methods.LIGHTHOUSE_SERVICE: {
                    "Quorum": unary_handler(methods.LIGHTHOUSE_QUORUM, self._quorum),
                    "Heartbeat": unary_handler(methods.LIGHTHOUSE_HEARTBEAT, self._heartbeat),
                },
                methods.SESSION_SERVICE: {
                    "Session": session_handler(self),
                    "Describe": unary_handler(methods.LIGHTHOUSE_DESCRIBE, self._describe),
                },
            },
            options=[
                *SERVER_OPTIONS,
                ("grpc.keepalive_time_ms", keepalive_ms),
                ("grpc.keepalive_timeout_ms", keepalive_ms),
            ],
            cleanup=self._stop_lane,
            security=security,
        )
        try:
            self._server.submit(self._start(host, direct_port)).result()
        except BaseException:
            self._server.shutdown()
            raise
        logger.info(
            "Lighthouse listening on %s (bound %s, direct session lane on port %s) with "
            "min_replicas=%d join_timeout_ms=%s quorum_tick_ms=%s heartbeat_timeout_ms=%s",
            self.address(),
            bind,
            self._lane.port or "none",
            self._config.min_replicas,
            self._config.join_timeout_ms,
            self._config.quorum_tick_ms,
            self._config.heartbeat_timeout_ms,
        )

    # ---------------------------------------------------------------------------------------
    # Public API

    def address(self) -> str:
        """The URL replicas use to reach this lighthouse, ``http://{hostname}:{port}``."""
        return f"http://{format_target(socket.gethostname(), self._server.port)}"

    def port(self) -> int:
        """The TCP port the lighthouse listens on."""
        return self._server.port

    def direct_port(self) -> int:
        """The TCP port of the direct session lane (0: none)."""
        return self._lane.port

    def shutdown(self) -> None:
        """Stop serving; waiting quorum requests are cancelled. Idempotent, thread-safe."""
        self._server.shutdown()

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot for status views: ``quorum_id``, ``reason`` (what a decision now
        would say), ``prev_quorum`` (None, or its ``quorum_id``, ``age_s``, ``max_step`` and
        ``participants``), ``waiting`` (ids), ``heartbeats`` (id -> age in s), ``config``."""
        reason, prev, heartbeats, waiting, quorum_id = self._rounds.snapshot()
        prev_view = None
        if prev is not None:
            prev_view = {
                "quorum_id": prev.quorum_id,
                "age_s": max(0.0, time.time() - prev.created.to_float()),
                "max_step": max((m.step for m in prev.participants), default=-1),
                "participants": [_member_view(m) for m in prev.participants],
            }
        return {
            "quorum_id": quorum_id,
            "reason": reason,
            "prev_quorum": prev_view,
            "waiting": waiting,
            "heartbeats": dict(sorted(heartbeats.items())),
            "config": {
                "min_replicas": self._config.min_replicas,
                "join_timeout_ms": self._config.join_timeout_ms,
                "quorum_tick_ms": self._config.quorum_tick_ms,
                "heartbeat_timeout_ms": self._config.heartbeat_timeout_ms,
            },
        }

    # ---------------------------------------------------------------------------------------
    # Start, stop, ticks

    async def _start(self, host: str, direct_port: int | None) -> None:
        if direct_port is not None:
            try:
                await self._lane.start(host, direct_port)
            except OSError as e:
                raise RuntimeError(
                    f"lighthouse: failed to bind the direct session lane on "
                    f"{format_target(host, direct_port)}: {e}"
                ) from e
        self._server.spawn(self._tick_loop())

    async def _stop_lane(self) -> None:
        self._lane.close()

    async def _tick_loop(self) -> None:
        period = self._config.quorum_tick_ms / 1000.0
        while True:
            await asyncio.sleep(period)
            self._rounds.tick()
            self._rounds.arm_timers()
            self._sessions.on_tick()

    def _notify(self, event: str, *args: Any) -> None:
        # An observer's bug must never take the lighthouse down.
        try:
            getattr(self._observer, event)(*args)
        except Exception:
            logger.exception("lighthouse observer failed on %s", event)

    # ---------------------------------------------------------------------------------------
    # RPCs

    async def _heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.LighthouseHeartbeatResponse:
        check_replica_id(request.replica_id, "replica_id", "missing replica_id")
        self.record_heartbeat(request.replica_id)
        return pb.LighthouseHeartbeatResponse()

    async def _quorum(
        self, request: pb.LighthouseQuorumRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        if not request.HasField("requester"):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing requester")
        raw = request.requester
        member = validated_member(raw)
        answer: asyncio.Future[Issued] = asyncio.get_running_loop().create_future()
        waiter = self._rounds.wait(
            member, raw, lambda issued: answer.done() or answer.set_result(issued)
        )
        self._rounds.run_due()
        try:
            issued = await answer
        finally:
            # A call that went away stays registered for the round, as the reference's does.
            self._rounds.forget(waiter)
        return issued.unary_response

    async def _describe(
        self, request: spb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> spb.Description:
        return spb.Description(protocol=methods.SESSION_PROTOCOL, session_port=self._lane.port)

    # ---------------------------------------------------------------------------------------
    # What the sessions need (loop thread only; see session._Lighthouse)

    @property
    def heartbeat_timeout_ms(self) -> int:
        """After how long without a heartbeat a group is dropped (told in each Welcome)."""
        return self._config.heartbeat_timeout_ms

    def record_heartbeat(self, replica_id: str) -> None:
        """A group said it is alive (a unary Heartbeat, or one on its session)."""
        self._rounds.heartbeat(replica_id)
        observer = self._observer
        if observer is not None:
            try:
                observer.heartbeat(replica_id)
            except Exception:
                logger.exception("lighthouse observer failed on heartbeat")

    def open_session(
        self, replica_id: str, peer: Peer, last_quorum: pb.Quorum | None = None
    ) -> int:
        """A group opened its session; returns the latest quorum id."""
        return self._sessions.open(replica_id, peer, last_quorum)

    def missed_notice(self, replica_id: str, last_quorum: pb.Quorum | None) -> bytes | None:
        """The notice about itself a group missed while it had no session, if any."""
        return self._sessions.missed(replica_id, last_quorum)

    def end_session(self, replica_id: str, peer: Peer, reason: str, steps_done: int = 0) -> None:
        """A group's session ended: the group is gone now (unless a newer session replaced it)."""
        self._sessions.end(replica_id, peer, reason, steps_done)

    def gave_up(self, replica_id: str, peer: Peer, quorum_id: int, reason: str) -> None:
        """A group gave up building quorum ``quorum_id``'s process group: tell the others."""
        self._sessions.gave_up(replica_id, peer, quorum_id, reason)

    def wait_for_quorum(
        self,
        member: QuorumMember,
        raw: pb.QuorumMember,
        deliver: Callable[[Issued], None],
        timeout_s: float,
        expired: Callable[[], None],
        lineage: int = 0,
    ) -> Waiter:
        """A session's quorum request (``QuorumRounds.wait_until``)."""
        return self._rounds.wait_until(member, raw, deliver, timeout_s, expired, lineage)

    def withdraw(self, request: Waiter) -> None:
        """A session's request that nobody waits for any more (replaced, or its session ended)."""
        self._rounds.withdraw(request)

    def decide_if_due(self) -> None:
        """All one read brought has joined: decide now if due (``QuorumRounds.run_due``)."""
        self._rounds.run_due()


def _member_view(member: QuorumMember) -> dict[str, Any]:
    return {
        "replica_id": member.replica_id,
        "address": member.address,
        "store_address": member.store_address,
        "step": member.step,
        "world_size": member.world_size,
        "shrink_only": member.shrink_only,
        "commit_failures": member.commit_failures,
    }
