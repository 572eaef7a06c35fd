"""The manager server: one per replica group, run by group rank 0 (reference §5).

It gathers its ranks' ``Quorum`` calls into one lighthouse request per step (``round.py``),
heartbeats the lighthouse, answers each rank with its view of the quorum (``plan.py``), runs the
commit vote (``group/vote.py``), serves checkpoint metadata and can be told to exit. It only moves
requests, time and answers in and out of those pure cores; state lives on its event-loop thread.

Deliberate differences from the reference:

* When the lighthouse call fails, every rank waiting on that round gets the failure at once.
* A rank whose ``Quorum`` call is cancelled before its round started is taken out of the round.
* Impossible values (``group_rank`` outside the group, negative ``step``, a vote for another
  step) are rejected with ``INVALID_ARGUMENT``.
* ``Kill`` answers before exiting, so the caller learns that the request arrived.

With a torchheal lighthouse it keeps one session open (``link.py``) and forwards its
``MemberLost`` notices to every rank (``notices.py``), so each can abort a collective in flight
with the lost group; with a reference lighthouse it speaks the unary protocol, as torchft does.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio

from torchheal._base.security import SecurityEnv
from torchheal._base.timeouts import to_seconds
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.group.dial import LinkError, connect_first, split_addresses
from torchheal.coordination.group.in_process import InProcessRank, ServerGone
from torchheal.coordination.group.link import LighthouseLink
from torchheal.coordination.group.notices import NoticeFanout
from torchheal.coordination.group.quorum_request import (
    MIN_RETRY_SLEEP_S,
    LighthouseFailed,
    request_quorum,
)
from torchheal.coordination.group.vote import GroupVote
from torchheal.coordination.plan import NotParticipatingError, compute_quorum_results
from torchheal.coordination.round import QuorumRound, RetryPolicy, RoundStart
from torchheal.coordination.rpc.addresses import format_target, parse_address
from torchheal.coordination.rpc.errors import StatusError
from torchheal.coordination.rpc.in_process import InProcessCaller
from torchheal.coordination.rpc.server import AioServerThread, unary_handler, unary_stream_handler
from torchheal.coordination.types import Notice, Quorum, QuorumAsk, QuorumMember, QuorumResult

__all__ = ["ManagerServer"]

logger: logging.Logger = logging.getLogger(__name__)

# Longest wait for the lighthouse session's goodbye to leave at shutdown.
GOODBYE_TIMEOUT_S = 2.0
# The process exits this long after answering a Kill, so the answer can leave first.
KILL_EXIT_DELAY_S = 0.1


class ManagerServer(InProcessRank):
    """Per-replica-group coordinator; serves ``torchft.ManagerService``.

    Connects to the lighthouse and starts serving in the constructor, on a background thread
    with its own event loop, so the caller (a training process) never waits on it.

    Args:
        replica_id: the group's full id (the part before the first ``:`` names it in logs).
        lighthouse_addr: the lighthouse URL.
        hostname: host name other groups use to reach this server (goes into ``address()``).
        bind: address to listen on, e.g. ``"[::]:0"``.
        store_addr: ``host:port`` of this group's TCPStore, passed on to the other groups.
        world_size: number of ranks in the group; each round waits for all of them.
        heartbeat_interval: pause between heartbeats to the lighthouse.
        connect_timeout: how long to try to reach the lighthouse at start.
        quorum_retries: extra lighthouse attempts per round after a failure.
        last_quorum_id: the last quorum id an earlier process of this group configured (0:
            none); a restarted torchheal lighthouse without a record numbers quorums above it.
        security: job token and TLS settings (torchheal's; None: read from the environment).

    Raises:
        ValueError: an option is out of range or an address is malformed.
        RuntimeError: the lighthouse could not be reached within ``connect_timeout``, or
            ``bind`` could not be bound.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int = 0,
        *,
        last_quorum_id: int = 0,
        security: SecurityEnv | None = None,
    ) -> None:
        self._security = SecurityEnv.from_env() if security is None else security
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if isinstance(quorum_retries, bool) or not isinstance(quorum_retries, int):
            raise ValueError(f"quorum_retries must be an integer >= 0, got {quorum_retries!r}")
        if quorum_retries < 0:
            raise ValueError(f"quorum_retries must be an integer >= 0, got {quorum_retries!r}")
        self._heartbeat_interval_s = to_seconds(heartbeat_interval)
        if self._heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {heartbeat_interval!r}")
        self._replica_id = replica_id
        self._prefix = f"[Replica {replica_id.split(':', 1)[0]}]"
        self._lighthouse_addr = lighthouse_addr
        self._hostname = hostname
        self._store_addr = store_addr
        self._world_size = world_size
        self._quorum_retries = quorum_retries
        self._connect_timeout = connect_timeout
        self._last_quorum_id = last_quorum_id

        # Loop-thread state.
        self._checkpoint_metadata: dict[int, str] = {}
        # Who is in the group's quorum round, and the outcome each unstarted round's ranks
        # wait on (round id -> future; a started round's waiters hold their own reference).
        self._round = QuorumRound(world_size)
        self._round_outcomes: dict[int, asyncio.Future[Quorum]] = {}
        self._retry = RetryPolicy(quorum_retries, MIN_RETRY_SLEEP_S)
        # The commit vote: cast into from the loop (gRPC ranks) and from rank 0's thread.
        self._vote = GroupVote(
            world_size, self._prefix, fence=self._doubt, committed=self._committed
        )
        self._shut_down = False
        self._lighthouse: grpc.aio.Channel | None = None
        self._link: LighthouseLink | None = None
        # Who hears the lighthouse's lost-member notices (loop thread only).
        self._notices = NoticeFanout(replica_id, self._prefix)

        self._server_name = f"torchheal-manager-{replica_id.split(':', 1)[0]}"
        self._server = AioServerThread(
            self._server_name,
            bind,
            {
                methods.MANAGER_SERVICE: {
                    "Quorum": unary_handler(methods.MANAGER_QUORUM, self._quorum_rpc),
                    "CheckpointMetadata": unary_handler(
                        methods.MANAGER_CHECKPOINT_METADATA, self._checkpoint_metadata_rpc
                    ),
                    "ShouldCommit": unary_handler(
                        methods.MANAGER_SHOULD_COMMIT, self._should_commit_rpc
                    ),
                    "Kill": unary_handler(methods.MANAGER_KILL, self._kill),
                },
                methods.NOTICES_SERVICE: {
                    "Watch": unary_stream_handler(methods.MANAGER_WATCH, self._watch),
                    "ReportGaveUp": unary_handler(methods.MANAGER_GAVE_UP, self._gave_up_rpc),
                },
            },
            startup=self._connect_lighthouse,
            cleanup=self._close_lighthouse,
            security=self._security,
        )
        self._server.submit(self._start_heartbeat()).result()
        # Group rank 0 lives in this process: its calls run the handlers' coroutines directly.
        self._quorum_in_process = InProcessCaller(
            self._server.submit, methods.MANAGER_QUORUM, self.address()
        )
        self._commit_what = f"ManagerService/ShouldCommit to {self.address()}"
        self._quorum_what = f"ManagerService/Quorum to {self.address()}"
        logger.info(
            "%s manager server listening on %s, lighthouse %s",
            self._prefix,
            self.address(),
            lighthouse_addr,
        )

    # ---------------------------------------------------------------------------------------
    # Public API

    def address(self) -> str:
        """The URL other ranks and groups use to reach this server, ``http://{hostname}:{port}``."""
        return f"http://{format_target(self._hostname, self._server.port)}"

    def port(self) -> int:
        """The TCP port the server listens on."""
        return self._server.port

    def shutdown(self) -> None:
        """Stop serving and heartbeating; waiting calls are cancelled. Idempotent, thread-safe.

        With a torchheal lighthouse the session says goodbye first, so the other groups go on
        without this one at once.
        """
        self._shut_down = True
        link = self._link
        if link is not None and link.session_mode:
            try:
                self._server.submit(link.close()).result(timeout=GOODBYE_TIMEOUT_S)
            except Exception:  # already shut down, or the lighthouse is gone: nothing to tell
                pass
        self._server.shutdown()

    @property
    def session_mode(self) -> bool:
        """Whether the lighthouse link is a torchheal session (False: a reference lighthouse)."""
        return bool(self._link is not None and self._link.session_mode)

    @property
    def joined_running_job(self) -> bool:
        """Whether the lighthouse had already issued a quorum when this group first said hello
        (then the group warms up before it counts). Always False with a reference lighthouse."""
        link = self._link
        return bool(link is not None and link.joined_running)

    def add_lost_listener(self, listener: Callable[[Notice], None]) -> None:
        """Also tell ``listener`` each :class:`~torchheal.coordination.types.Notice` (for a rank
        in this process); it runs on the event-loop thread, so must be quick and thread-safe."""

        async def add() -> None:
            self._notices.add_listener(listener)

        self._server.submit(add()).result()

    def report_gave_up(self, quorum_id: int, reason: str) -> None:
        """A rank of this group gave up building quorum ``quorum_id``'s process group: tell the
        lighthouse (a torchheal session of protocol >= 2 only), which tells the other groups
        waiting in that build. Any thread; does not wait for the lighthouse."""
        if self._link is None:
            return
        try:
            self._server.submit(self._link.gave_up(quorum_id, reason))
        except RuntimeError:  # shut down: nobody to tell
            pass

    # ---------------------------------------------------------------------------------------
    # Lighthouse connection and heartbeats

    async def _connect_lighthouse(self) -> None:
        # Several comma-separated addresses: the lighthouses of a highly available job.
        addresses = split_addresses(self._lighthouse_addr)
        self._lighthouse, first = await connect_first(
            addresses, self._connect_timeout, self._security
        )
        self._link = LighthouseLink(
            self._lighthouse,
            self._replica_id,
            self._heartbeat_interval_s,
            self._notices.forward,
            first,
            self._prefix,
            host=parse_address(first)[0],
            addresses=addresses,
            last_quorum_id=self._last_quorum_id,
            security=self._security,
        )
        try:
            await self._link.start()
        except LinkError as e:
            raise RuntimeError(
                f"{self._prefix} cannot open a session with lighthouse {self._lighthouse_addr}: {e}"
            ) from None

    async def _close_lighthouse(self) -> None:
        self._vote.abandon(ServerGone("manager server shut down"))
        if self._link is not None:
            await self._link.close()
        if self._lighthouse is not None:
            await self._lighthouse.close()

    def _committed(self, steps_done: int) -> None:
        """The group committed a step (any thread): in the link's last quorum, and it is now
        between steps with ``steps_done`` committed."""
        link = self._link
        if link is not None:
            link.holds_last_quorum(steps_done)

    def healed(self) -> None:
        """Group rank 0 loaded a peer's state in the last quorum (any thread)."""
        link = self._link
        if link is not None:
            link.holds_last_quorum()

    def _doubt(self) -> str | None:
        """Why the lighthouse may have dropped the group during the step, or None (any thread)."""
        link = self._link
        return None if link is None else link.doubt()

    async def _start_heartbeat(self) -> None:
        assert self._link is not None
        self._server.spawn(self._link.run())

    # ---------------------------------------------------------------------------------------
    # Lost-member notices

    async def _gave_up_rpc(
        self, request: spb.GaveUp, context: grpc.aio.ServicerContext
    ) -> spb.GaveUpAck:
        if request.quorum_id <= 0:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT, f"quorum_id must be > 0, got {request.quorum_id}"
            )
        if self._link is not None:  # (the reason is passed on as is: the lighthouse bounds it)
            await self._link.gave_up(request.quorum_id, request.reason)
        return spb.GaveUpAck()

    async def _watch(
        self, request: spb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        try:
            self._round.check(request.group_rank, 0, 0)
        except ValueError as e:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        async for notice in self._notices.watch():
            yield notice

    # ---------------------------------------------------------------------------------------
    # Quorum

    async def _quorum_rpc(
        self, request: pb.ManagerQuorumRequest, context: grpc.aio.ServicerContext
    ) -> pb.ManagerQuorumResponse:
        remaining = context.time_remaining()
        if remaining is None:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing timeout")
        ask = convert.quorum_ask_from_pb(request, timedelta(seconds=remaining))
        result = await self._join_quorum(ask, remaining)
        return convert.quorum_result_to_pb(result)

    async def _join_quorum(self, ask: QuorumAsk, remaining: float) -> QuorumResult:
        """One rank's part of a quorum round (gRPC and in-process); raises :class:`StatusError`,
        or ``CancelledError`` when the caller's deadline passed (the rank leaves the round)."""
        rank, step = ask.group_rank, ask.step
        try:
            self._round.check(rank, step, ask.commit_failures)
        except ValueError as e:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self._checkpoint_metadata[rank] = ask.checkpoint_metadata
        member = QuorumMember(
            replica_id=self._replica_id,
            address=self.address(),
            store_address=self._store_addr,
            step=step,
            world_size=self._world_size,
            shrink_only=ask.shrink_only,
            data=convert.group_data(ask.data),  # (the round keeps rank 0's)
            commit_failures=ask.commit_failures,
        )
        joined = self._round.join(rank, member, asyncio.get_running_loop().time(), remaining)
        outcome = self._round_outcomes.get(joined.round_id)
        if outcome is None:
            outcome = self._round_outcomes[joined.round_id] = _new_future()
        logger.debug(
            "%s rank %d asks for a quorum at step %d (%d/%d ranks)",
            self._prefix,
            rank,
            step,
            self._world_size if joined.start else len(self._round.waiting),
            self._world_size,
        )
        if joined.start is not None:
            del self._round_outcomes[joined.round_id]
            self._server.spawn(self._run_quorum(joined.start, outcome))

        try:
            # shield: one rank giving up must not cancel the round the others wait on.
            quorum = await asyncio.shield(outcome)
        except asyncio.CancelledError:
            if self._round.leave(rank, joined.round_id, member):
                logger.info(
                    "%s rank %d left the quorum round before it started", self._prefix, rank
                )
            raise
        except LighthouseFailed as e:
            raise StatusError(e.code, e.details) from None

        try:
            return compute_quorum_results(self._replica_id, rank, quorum, ask.init_sync)
        except NotParticipatingError as e:
            raise StatusError(grpc.StatusCode.NOT_FOUND, str(e)) from None

    async def _run_quorum(self, start: RoundStart, outcome: asyncio.Future[Quorum]) -> None:
        """Make the group's lighthouse request (retried as the policy says); settle ``outcome``."""
        assert self._link is not None
        try:
            outcome.set_result(await request_quorum(self._link, start, self._retry, self._prefix))
        except LighthouseFailed as e:
            outcome.set_exception(e)

    # ---------------------------------------------------------------------------------------
    # Commit vote, checkpoint metadata, kill

    async def _should_commit_rpc(
        self, request: pb.ShouldCommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.ShouldCommitResponse:
        try:
            # Also rejects a group rank outside the group, and a stale vote (StaleVoteError).
            round_ = self._vote.cast(
                request.group_rank, request.step, request.should_commit, request.salvageable
            )
        except ValueError as e:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        # shield: a rank that gives up keeps its vote in the round, as before its deadline.
        try:
            decision = await asyncio.shield(asyncio.wrap_future(round_))
        except ServerGone as e:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        return pb.ShouldCommitResponse(should_commit=decision.commit, redo=decision.redo)

    async def _checkpoint_metadata_rpc(
        self, request: pb.CheckpointMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointMetadataResponse:
        metadata = self._checkpoint_metadata.get(request.rank)
        if metadata is None:
            # Worded as the reference's; its tests match this text.
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "rank not found")
        return pb.CheckpointMetadataResponse(checkpoint_metadata=metadata)

    async def _kill(
        self, request: pb.KillRequest, context: grpc.aio.ServicerContext
    ) -> pb.KillResponse:
        logger.warning("%s got kill request: %s; exiting", self._prefix, request.msg)
        # Exit shortly after answering, so the caller sees success instead of a broken call.
        asyncio.get_running_loop().call_later(KILL_EXIT_DELAY_S, os._exit, 1)
        return pb.KillResponse()


def _new_future() -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    # Mark a failure as retrieved even when every waiter is gone, to keep the log clean.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future
