"""Blocking clients of the lighthouse and of a replica group's manager server.

Both connect in the constructor (``RuntimeError`` if the server cannot be reached within
``connect_timeout``), send every call with its own deadline (the ``grpc-timeout`` header, which
the servers enforce), and map failures as the reference does: deadline or cancellation ->
``TimeoutError``; anything else -> ``RuntimeError`` (:class:`~torchheal.coordination.rpc.errors.RPCError`)
carrying the server's status and message. They are safe to share between threads.
Their twin for a caller living in the server's own process (group rank 0 and its
ManagerServer) is :class:`~torchheal.coordination.rpc.in_process.InProcessCaller`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc

from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.rpc.channels import UnaryCaller, connect, serialize
from torchheal.coordination.rpc.errors import rpc_error_to_exception
from torchheal.coordination.types import Quorum, QuorumResult

__all__ = ["LighthouseClient", "ManagerClient"]

logger: logging.Logger = logging.getLogger(__name__)


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
        self._watches: list[Any] = []

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

    def _watch(self, group_rank: int) -> Iterator[spb.MemberLost]:
        """The lighthouse's lost-member notices, as the manager server forwards them.

        Blocks between notices; ends (``RuntimeError``) when the server goes away. torchheal
        only: a reference manager server does not serve it.

        Args:
            group_rank: this rank's index in its replica group.

        Raises:
            RuntimeError: the stream broke (the server is gone or refused the request).
        """
        call = self._channel.unary_stream(
            methods.MANAGER_WATCH.path,
            request_serializer=serialize,
            response_deserializer=spb.Notice.FromString,
        )(spb.WatchRequest(group_rank=group_rank))
        self._watches.append(call)
        try:
            for notice in call:
                if notice.WhichOneof("kind") == "lost":
                    yield notice.lost
        except grpc.RpcError as e:
            raise rpc_error_to_exception(e, f"ManagerNotices/Watch to {self._addr}") from None
        finally:
            call.cancel()
            self._watches.remove(call)

    def close(self) -> None:
        """Close the connection (ending any watch); later calls fail with ``RuntimeError``."""
        for call in self._watches:
            call.cancel()
        self._channel.close()
