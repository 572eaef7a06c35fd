"""The manager server: one per replica group, run by group rank 0 (reference §5).

It gathers the ``Quorum`` calls of all ranks of its group into one lighthouse request per step,
heartbeats the lighthouse, answers each rank with its own view of the quorum (computed by the
pure ``plan.compute_quorum_results``), runs the per-step commit vote (the pure
``vote.CommitVote``), serves checkpoint metadata to healing peers, and can be told to exit.

All state is touched only on the server's event-loop thread, so it needs no lock.

Deliberate differences from the reference:

* When the lighthouse call finally fails, every rank waiting on that round gets the failure at
  once (``INTERNAL``, or ``DEADLINE_EXCEEDED`` when the lighthouse timed out) instead of hanging
  until its own deadline.
* A rank whose ``Quorum`` call is cancelled (deadline, client gone) before its round started is
  taken out of the round, so its stale registration cannot complete a later round on its own.
* Requests with impossible values (``group_rank`` outside the group, negative ``step``) are
  rejected with ``INVALID_ARGUMENT``; a commit vote for another step than the one being decided
  is rejected too (the reference ignores ``step``).
* ``Kill`` answers before exiting (the process exits ~100 ms after the call), so the caller
  learns that the request arrived.
"""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio

from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.grpc_util import (
    AioServerThread,
    StatusError,
    aio_connect,
    format_target,
    rpc_error_to_exception,
    status_name,
    to_seconds,
    unary_handler,
)
from torchheal.coordination.plan import NotParticipatingError, compute_quorum_results
from torchheal.coordination.types import Quorum, QuorumMember
from torchheal.coordination.vote import CommitVote, Decision, StaleVoteError

__all__ = ["ManagerServer"]

logger: logging.Logger = logging.getLogger(__name__)

# How long a heartbeat may take; a lighthouse that slow is as good as unreachable.
HEARTBEAT_CALL_TIMEOUT_S = 2.0
# The process exits this long after answering a Kill, so the answer can leave first.
KILL_EXIT_DELAY_S = 0.1
# Minimum pause between lighthouse attempts (reference §5).
MIN_RETRY_SLEEP_S = 0.1


class _LighthouseFailed(Exception):
    """The lighthouse call of a round failed for good; carries the status to give the ranks."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class ManagerServer:
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
    ) -> None:
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

        # Loop-thread state.
        self._checkpoint_metadata: dict[int, str] = {}
        self._participants: dict[int, QuorumMember] = {}
        self._round: asyncio.Future[Quorum] | None = None
        self._vote = CommitVote(world_size)
        self._commit_round: asyncio.Future[Decision] | None = None
        self._lighthouse: grpc.aio.Channel | None = None
        self._lh_quorum: Any = None
        self._lh_heartbeat: Any = None

        self._server = AioServerThread(
            f"torchheal-manager-{replica_id.split(':', 1)[0]}",
            bind,
            {
                methods.MANAGER_SERVICE: {
                    "Quorum": unary_handler(methods.MANAGER_QUORUM, self._quorum),
                    "CheckpointMetadata": unary_handler(
                        methods.MANAGER_CHECKPOINT_METADATA, self._checkpoint_metadata_rpc
                    ),
                    "ShouldCommit": unary_handler(
                        methods.MANAGER_SHOULD_COMMIT, self._should_commit
                    ),
                    "Kill": unary_handler(methods.MANAGER_KILL, self._kill),
                }
            },
            startup=self._connect_lighthouse,
            cleanup=self._close_lighthouse,
        )
        self._server.submit(self._start_heartbeat()).result()
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
        """Stop serving and heartbeating; waiting calls are cancelled. Idempotent, thread-safe."""
        self._server.shutdown()

    # ---------------------------------------------------------------------------------------
    # Lighthouse connection and heartbeats

    async def _connect_lighthouse(self) -> None:
        self._lighthouse = await aio_connect(self._lighthouse_addr, self._connect_timeout)
        self._lh_quorum = self._lighthouse.unary_unary(
            methods.LIGHTHOUSE_QUORUM.path,
            request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
            response_deserializer=pb.LighthouseQuorumResponse.FromString,
        )
        self._lh_heartbeat = self._lighthouse.unary_unary(
            methods.LIGHTHOUSE_HEARTBEAT.path,
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )

    async def _close_lighthouse(self) -> None:
        if self._lighthouse is not None:
            await self._lighthouse.close()

    async def _start_heartbeat(self) -> None:
        self._server.spawn(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        # The channel reconnects by itself after a lighthouse restart, so unlike the reference
        # there is no client to rebuild; we only report the outage once and its end once.
        request = pb.LighthouseHeartbeatRequest(replica_id=self._replica_id)
        failing = False
        while True:
            try:
                await self._lh_heartbeat(request, timeout=HEARTBEAT_CALL_TIMEOUT_S)
                if failing:
                    logger.info("%s heartbeats to the lighthouse work again", self._prefix)
                    failing = False
            except grpc.aio.AioRpcError as e:
                if not failing:
                    logger.warning(
                        "%s heartbeat to lighthouse %s failed: %s",
                        self._prefix,
                        self._lighthouse_addr,
                        rpc_error_to_exception(e, "Heartbeat"),
                    )
                    failing = True
            await asyncio.sleep(self._heartbeat_interval_s)

    # ---------------------------------------------------------------------------------------
    # Quorum

    async def _quorum(
        self, request: pb.ManagerQuorumRequest, context: grpc.aio.ServicerContext
    ) -> pb.ManagerQuorumResponse:
        remaining = context.time_remaining()
        if remaining is None:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "missing timeout")
        rank = request.group_rank
        self._check_rank(rank)
        if request.step < 0:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT, f"step must be >= 0, got {request.step}"
            )
        if request.commit_failures < 0:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"commit_failures must be >= 0, got {request.commit_failures}",
            )

        self._checkpoint_metadata[rank] = request.checkpoint_metadata
        member = QuorumMember(
            replica_id=self._replica_id,
            address=self.address(),
            store_address=self._store_addr,
            step=request.step,
            world_size=self._world_size,
            shrink_only=request.shrink_only,
            data=None,
            commit_failures=request.commit_failures,
        )
        if self._round is None:
            self._round = _new_future()
        round_ = self._round
        self._participants[rank] = member
        logger.debug(
            "%s rank %d asks for a quorum at step %d (%d/%d ranks)",
            self._prefix,
            rank,
            request.step,
            len(self._participants),
            self._world_size,
        )
        if len(self._participants) == self._world_size:
            # The last rank to arrive speaks for the group (its step, shrink_only and
            # commit_failures), as in the reference.
            self._participants = {}
            self._round = None
            self._server.spawn(self._run_quorum(member, remaining, round_))

        try:
            # shield: one rank giving up must not cancel the round the others wait on.
            quorum = await asyncio.shield(round_)
        except asyncio.CancelledError:
            if self._round is round_ and self._participants.get(rank) is member:
                del self._participants[rank]
                logger.info(
                    "%s rank %d left the quorum round before it started", self._prefix, rank
                )
            raise
        except _LighthouseFailed as e:
            raise StatusError(e.code, e.details) from None

        try:
            result = compute_quorum_results(self._replica_id, rank, quorum, request.init_sync)
        except NotParticipatingError as e:
            raise StatusError(grpc.StatusCode.NOT_FOUND, str(e)) from None
        return convert.quorum_result_to_pb(result)

    async def _run_quorum(
        self, member: QuorumMember, timeout_s: float, round_: asyncio.Future[Quorum]
    ) -> None:
        """Make the group's lighthouse request, with retries, and settle ``round_``."""
        request = pb.LighthouseQuorumRequest(requester=convert.member_to_pb(member))
        retries = self._quorum_retries
        attempt = 0
        while True:
            try:
                response = await asyncio.wait_for(
                    self._lh_quorum(request, timeout=timeout_s), timeout_s
                )
                if not response.HasField("quorum"):
                    round_.set_exception(
                        _LighthouseFailed(
                            grpc.StatusCode.INTERNAL, "lighthouse answered without a quorum"
                        )
                    )
                    return
                quorum = convert.quorum_from_pb(response.quorum, strict_data=False)
                logger.debug(
                    "%s got quorum %d with %d participants",
                    self._prefix,
                    quorum.quorum_id,
                    len(quorum.participants),
                )
                round_.set_result(quorum)
                return
            except grpc.aio.AioRpcError as e:
                sleep_s = max(MIN_RETRY_SLEEP_S, timeout_s / (retries + 1))
                code = e.code()
                timed_out = code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
                last = f"status: {status_name(code)}, message: {e.details()!r}"
            except asyncio.TimeoutError:
                sleep_s = MIN_RETRY_SLEEP_S
                timed_out = True
                last = f"no answer within {timeout_s:.3f}s"
            logger.warning(
                "%s lighthouse quorum attempt %d/%d failed: %s",
                self._prefix,
                attempt + 1,
                retries + 1,
                last,
            )
            if attempt >= retries:
                code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.INTERNAL
                round_.set_exception(
                    _LighthouseFailed(
                        code,
                        f"lighthouse quorum failed after {retries} retries. last error: {last}",
                    )
                )
                return
            attempt += 1
            await asyncio.sleep(sleep_s)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self._world_size:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"group_rank {rank} is outside [0, {self._world_size}) for a replica group "
                f"of world_size {self._world_size}",
            )

    # ---------------------------------------------------------------------------------------
    # Commit vote, checkpoint metadata, kill

    async def _should_commit(
        self, request: pb.ShouldCommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.ShouldCommitResponse:
        self._check_rank(request.group_rank)
        if self._commit_round is None:
            self._commit_round = _new_future()
        round_ = self._commit_round
        try:
            decision = self._vote.cast(request.group_rank, request.step, request.should_commit)
        except StaleVoteError as e:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except ValueError as e:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        if decision is not None:
            self._commit_round = None
            # Per step, so DEBUG; a failed vote is worth a user's attention.
            (logger.debug if decision.commit else logger.info)(
                "%s step %d: should_commit=%s (failed ranks: %s)",
                self._prefix,
                decision.step,
                decision.commit,
                sorted(decision.failed_ranks),
            )
            round_.set_result(decision)
        decision = await asyncio.shield(round_)
        return pb.ShouldCommitResponse(should_commit=decision.commit)

    async def _checkpoint_metadata_rpc(
        self, request: pb.CheckpointMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointMetadataResponse:
        metadata = self._checkpoint_metadata.get(request.rank)
        if metadata is None:
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
