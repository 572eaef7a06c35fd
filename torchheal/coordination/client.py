"""Blocking clients of the lighthouse and of a replica group's manager server.

Both connect in the constructor (``RuntimeError`` if the server cannot be reached within
``connect_timeout``), send every call with its own deadline (the ``grpc-timeout`` header, which
the servers enforce), and map failures as the reference does: deadline or cancellation ->
``TimeoutError``; anything else -> ``RuntimeError`` (:class:`~torchheal.coordination.grpc_util.RPCError`)
carrying the server's status and message. They are safe to share between threads.

:class:`InProcessCaller` is their twin for a caller living in the server's own process (group
rank 0 and its ManagerServer): it runs the handler's coroutine on the server's loop under the same
deadline and raises the same errors, without the gRPC round trip.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, Generic, TypeVar

import grpc

from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.methods import Method
from torchheal.coordination import convert
from torchheal.coordination.grpc_util import (
    RPCError,
    StatusError,
    UnaryCaller,
    connect,
    status_name,
    to_seconds,
)
from torchheal.coordination.types import Quorum, QuorumResult

__all__ = ["InProcessCaller", "LighthouseClient", "ManagerClient"]

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")

# An in-process call's deadline is enforced on the server's loop; the calling thread waits this
# much longer only to give up on a loop that does not answer at all.
IN_PROCESS_GRACE_S = 5.0


class LighthouseClient:
    """Client of the lighthouse, for tools and tests that talk to it directly.

    Args:
        addr: the lighthouse address, ``http://host:port`` or ``host:port``.
        connect_timeout: how long to keep trying to connect before raising.

    Raises:
        ValueError: ``addr`` is malformed.
        RuntimeError: the lighthouse could not be reached within ``connect_timeout``.
    """

    def __init__(self, addr: str, connect_timeout: timedelta) -> None:
        self._addr = addr
        self._channel = connect(addr, connect_timeout)
        self._quorum = UnaryCaller(self._channel, methods.LIGHTHOUSE_QUORUM, addr)
        self._heartbeat = UnaryCaller(self._channel, methods.LIGHTHOUSE_HEARTBEAT, addr)

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
        """Ask to join the next quorum and wait for it.

        Args:
            replica_id: the replica group's id.
            timeout: how long to wait for a quorum that includes this replica.
            address: the group's manager URL, passed on to the other members.
            store_address: ``host:port`` of the group's TCPStore.
            step: the group's current step.
            world_size: number of ranks in the group.
            shrink_only: only accept a quorum that drops members.
            data: a JSON-serialisable dict passed on to the other members.

        Returns:
            The issued quorum.

        Raises:
            TimeoutError: no quorum including this replica was issued within ``timeout``.
            RuntimeError: the lighthouse rejected the request or could not be reached.
            TypeError: ``data`` is not a JSON-serialisable dict.
        """
        member = pb.QuorumMember(
            replica_id=replica_id,
            address=address,
            store_address=store_address,
            step=step,
            world_size=world_size,
            shrink_only=shrink_only,
            data=convert.data_to_wire(data),
        )
        response = self._quorum(pb.LighthouseQuorumRequest(requester=member), timeout)
        if not response.HasField("quorum"):
            raise RuntimeError(f"lighthouse {self._addr} answered without a quorum")
        # Other members' data is passed through leniently: a peer of another implementation
        # may put any string there, and one odd member must not make the whole quorum unusable.
        return convert.quorum_from_pb(response.quorum, strict_data=False)

    def heartbeat(self, replica_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Tell the lighthouse this replica is alive.

        Args:
            replica_id: the replica group's id.
            timeout: deadline of the call.

        Raises:
            TimeoutError: no answer within ``timeout``.
            RuntimeError: the lighthouse rejected the call or could not be reached.
        """
        self._heartbeat(pb.LighthouseHeartbeatRequest(replica_id=replica_id), timeout)

    def close(self) -> None:
        """Close the connection; later calls fail with ``RuntimeError``."""
        self._channel.close()


class ManagerClient:
    """Client of a replica group's manager server, used by every rank's ``Manager``.

    Args:
        addr: the manager server address, ``http://host:port`` or ``host:port``.
        connect_timeout: how long to keep trying to connect before raising.

    Raises:
        ValueError: ``addr`` is malformed.
        RuntimeError: the server could not be reached within ``connect_timeout``.
    """

    def __init__(self, addr: str, connect_timeout: timedelta) -> None:
        self._addr = addr
        self._channel = connect(addr, connect_timeout)
        self._quorum_call = UnaryCaller(self._channel, methods.MANAGER_QUORUM, addr)
        self._metadata_call = UnaryCaller(self._channel, methods.MANAGER_CHECKPOINT_METADATA, addr)
        self._commit_call = UnaryCaller(self._channel, methods.MANAGER_SHOULD_COMMIT, addr)
        self._kill_call = UnaryCaller(self._channel, methods.MANAGER_KILL, addr)

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        init_sync: bool,
        commit_failures: int,
        timeout: timedelta,
    ) -> QuorumResult:
        """Join this step's quorum; returns once the whole group has a quorum.

        Args:
            group_rank: this rank's index in its replica group.
            step: this rank's current step.
            checkpoint_metadata: how healers fetch this rank's state (transport metadata).
            shrink_only: only accept a quorum that drops members.
            init_sync: heal replicas at step 0 from the primary so all start identical.
            commit_failures: consecutive failed commits of this rank.
            timeout: deadline of the whole quorum, also used for the lighthouse call.

        Returns:
            This rank's view of the quorum.

        Raises:
            TimeoutError: no quorum within ``timeout``.
            RuntimeError: the server rejected the request, the lighthouse call failed, or this
                group is not in the quorum.
        """
        request = pb.ManagerQuorumRequest(
            group_rank=group_rank,
            step=step,
            checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only,
            init_sync=init_sync,
            commit_failures=commit_failures,
        )
        return convert.quorum_result_from_pb(self._quorum_call(request, timeout))

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """Fetch the checkpoint metadata a group rank last reported to this server.

        Args:
            rank: the group rank whose metadata is wanted.
            timeout: deadline of the call.

        Raises:
            TimeoutError: no answer within ``timeout``.
            RuntimeError: the rank never reported metadata ("rank not found") or another error.
        """
        request = pb.CheckpointMetadataRequest(rank=rank)
        return self._metadata_call(request, timeout).checkpoint_metadata

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Vote on committing ``step``; returns True iff every rank of the group voted yes.

        Args:
            group_rank: this rank's index in its replica group.
            step: the step voted on.
            should_commit: this rank's vote.
            timeout: deadline of the call (waits for all ranks to vote).

        Raises:
            TimeoutError: not all ranks voted within ``timeout``.
            RuntimeError: the vote was rejected (e.g. a vote for another step) or another error.
        """
        request = pb.ShouldCommitRequest(
            should_commit=should_commit, group_rank=group_rank, step=step
        )
        return self._commit_call(request, timeout).should_commit

    def _kill(self, msg: str, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Ask the manager server's process to exit (used by dashboards and launchers).

        Args:
            msg: reason, logged by the server.
            timeout: deadline of the call.

        Raises:
            TimeoutError: no answer within ``timeout``.
            RuntimeError: the call failed (the process may still have exited).
        """
        self._kill_call(pb.KillRequest(msg=msg), timeout)

    def close(self) -> None:
        """Close the connection; later calls fail with ``RuntimeError``."""
        self._channel.close()


class _DeadlineExceeded(Exception):
    """An in-process call's deadline passed (over gRPC: ``DEADLINE_EXCEEDED``)."""


async def _with_deadline(call: Coroutine[Any, Any, T], timeout_s: float) -> T:
    # Cancel ``call`` at the deadline, as gRPC cancels a handler, and let its clean-up run
    # before the caller hears of the timeout. A timer on this task instead of asyncio.wait_for
    # spares a second task and a loop turn per call (this runs every training step).
    task = asyncio.current_task()
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        return await call
    except asyncio.CancelledError:
        if expired:
            raise _DeadlineExceeded() from None
        raise  # cancelled from outside: the server is shutting down
    finally:
        timer.cancel()


class InProcessCaller(Generic[T]):
    """A server handler called from the server's own process, with gRPC's deadline and errors.

    The handler coroutine runs on the server's event loop (all server state lives there) and is
    cancelled when ``timeout`` passes, as gRPC cancels a handler at the client's deadline. Errors
    are those :class:`UnaryCaller` raises for the same outcome over gRPC: ``TimeoutError`` at the
    deadline; :class:`RPCError` with the handler's :class:`StatusError` status, with
    ``UNAVAILABLE`` once the server is shut down, or ``INTERNAL`` for an unexpected exception.

    Args:
        submit: runs a coroutine on the server's loop from any thread and returns its future
            (``AioServerThread.submit``; raises ``RuntimeError`` once the server is shut down).
        method: the method the handler serves, for messages.
        target: the server's address, for messages.
    """

    def __init__(
        self,
        submit: Callable[[Coroutine[Any, Any, T]], concurrent.futures.Future[T]],
        method: Method,
        target: str,
    ) -> None:
        self._submit = submit
        self._method = method
        self._what = f"{method.service.removeprefix('torchft.')}/{method.name} to {target}"

    def __call__(self, call: Coroutine[Any, Any, T], timeout: timedelta | float) -> T:
        """Run ``call`` on the server's loop and wait at most ``timeout`` for its result.

        Args:
            call: the handler coroutine (not yet started).
            timeout: the call's deadline.

        Raises:
            TimeoutError: the deadline passed; ``call`` was cancelled.
            RPCError: the handler answered with an error status, or the server is shut down.
        """
        what = self._what
        timeout_s = to_seconds(timeout)
        try:
            future = self._submit(_with_deadline(call, timeout_s))
        except RuntimeError as e:
            call.close()  # never started: close it rather than leave it unawaited
            raise _status_error(what, grpc.StatusCode.UNAVAILABLE, str(e)) from None
        try:
            return future.result(timeout_s + IN_PROCESS_GRACE_S)
        except _DeadlineExceeded:
            raise TimeoutError(
                f'{what} failed: status: Cancelled, message: "Timeout expired" '
                f"(in-process deadline of {timeout_s:g}s exceeded)"
            ) from None
        except StatusError as e:
            raise _status_error(what, e.code, e.details) from None
        except concurrent.futures.CancelledError:
            # The loop cancelled the call: the server is shutting down.
            raise _status_error(
                what, grpc.StatusCode.UNAVAILABLE, "manager server shut down"
            ) from None
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f'{what} failed: status: Cancelled, message: "Timeout expired" '
                f"(the server loop did not answer within {timeout_s:g}s)"
            ) from None
        except Exception as e:
            # What unary_handler does on the gRPC path: log it and answer INTERNAL.
            logger.error("%s failed", self._method.path, exc_info=e)
            details = f"{self._method.path} failed: {e}"
            raise _status_error(what, grpc.StatusCode.INTERNAL, details) from None


def _status_error(what: str, code: grpc.StatusCode, details: str) -> RPCError:
    # The message rpc_error_to_exception builds for the same status over gRPC.
    return RPCError(
        f'{what} failed: status: {status_name(code)}, message: "{details}"', code, details
    )
