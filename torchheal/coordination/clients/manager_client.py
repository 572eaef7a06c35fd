"""The blocking client of a replica group's manager server, used by every rank's ``Manager``.

Every call carries its own deadline; failures map as in the reference: deadline or cancellation
-> ``TimeoutError``, anything else -> ``RuntimeError``
(:class:`~torchheal.coordination.rpc.errors.RPCError`). Safe to share between threads. Group
rank 0, in the server's process, uses ``rpc.in_process.InProcessCaller`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc

from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.rpc.channels import UnaryCaller, connect, serialize
from torchheal.coordination.rpc.errors import rpc_error_to_exception
from torchheal.coordination.types import QuorumAsk, QuorumResult

__all__ = ["ManagerClient"]


class ManagerClient:
    """Client of a replica group's manager server, used by every rank's ``Manager``.

    Args:
        addr: the manager server address, ``http://host:port`` or ``host:port``.
        connect_timeout: how long to keep trying to connect before raising.
        security: job token and TLS settings (torchheal's; None: read from the environment).

    Raises:
        ValueError: ``addr`` or the security settings are malformed.
        RuntimeError: the server could not be reached within ``connect_timeout``.
    """

    # Built in __new__, as the reference's extension type is: the reference's tests patch it
    # with autospec and reach the instance mock by calling the class mock with no arguments.
    def __new__(
        cls, addr: str, connect_timeout: timedelta, *, security: SecurityEnv | None = None
    ) -> ManagerClient:
        self = super().__new__(cls)
        self._addr = addr
        security = SecurityEnv.from_env() if security is None else security
        self._channel = connect(addr, connect_timeout, security)
        self._quorum_call = UnaryCaller(self._channel, methods.MANAGER_QUORUM, addr)
        self._metadata_call = UnaryCaller(self._channel, methods.MANAGER_CHECKPOINT_METADATA, addr)
        self._commit_call = UnaryCaller(self._channel, methods.MANAGER_SHOULD_COMMIT, addr)
        self._kill_call = UnaryCaller(self._channel, methods.MANAGER_KILL, addr)
        self._gave_up_call = UnaryCaller(self._channel, methods.MANAGER_GAVE_UP, addr)
        self._watches: list[Any] = []
        return self

    def quorum(self, ask: QuorumAsk) -> QuorumResult:
        """Join this step's quorum; returns this rank's view once the whole group has one.

        ``ask.timeout`` bounds the whole quorum (``TimeoutError``); ``RuntimeError`` if the
        server rejected the request, the lighthouse call failed, or the group is not in it.
        """
        request = convert.quorum_ask_to_pb(ask)
        return convert.quorum_result_from_pb(self._quorum_call(request, ask.timeout))

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
        """The reference's name and signature for :meth:`quorum` (its tests patch it)."""
        return self.quorum(
            QuorumAsk(
                group_rank,
                step,
                checkpoint_metadata,
                shrink_only,
                init_sync,
                commit_failures,
                timeout,
            )
        )

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """Fetch the checkpoint metadata group rank ``rank`` last reported to this server.

        ``RuntimeError`` ("rank not found") if it never did.
        """
        request = pb.CheckpointMetadataRequest(rank=rank)
        return self._metadata_call(request, timeout).checkpoint_metadata

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """Vote on committing ``step``; returns True iff every rank of the group voted yes.

        Raises:
            TimeoutError: not all ranks voted within ``timeout``.
            RuntimeError: the vote was rejected (e.g. a vote for another step) or another error.
        """
        return self.vote(group_rank, step, should_commit, False, timeout)[0]

    def vote(
        self, group_rank: int, step: int, should_commit: bool, salvageable: bool, timeout: timedelta
    ) -> tuple[bool, bool]:
        """:meth:`should_commit` with torchheal's salvage: returns ``(commit, redo)``.

        ``salvageable`` (with a "no"): a redo of the step would cure this rank's failure;
        ``redo``: every rank of the group redoes the step and votes again. A reference server
        ignores the one and never sets the other.
        """
        request = pb.ShouldCommitRequest(
            should_commit=should_commit, group_rank=group_rank, step=step, salvageable=salvageable
        )
        response = self._commit_call(request, timeout)
        return response.should_commit, response.redo

    def kill(self, msg: str, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Ask the manager server's process to exit, logging ``msg`` (dashboards, launchers).

        ``RuntimeError`` if the call failed (the process may still have exited).
        """
        self._kill_call(pb.KillRequest(msg=msg), timeout)

    def gave_up(self, quorum_id: int, reason: str, timeout: timedelta) -> None:
        """Tell the manager server that this rank gave up building quorum ``quorum_id``'s
        process group; the server tells the lighthouse, which tells the other groups. torchheal
        only: a reference manager server does not serve it."""
        self._gave_up_call(spb.GaveUp(quorum_id=quorum_id, reason=reason), timeout)

    def watch(self, group_rank: int) -> Iterator[spb.MemberLost]:
        """The lighthouse's lost-member notices, as the manager server forwards them.

        Blocks between notices; ends with ``RuntimeError`` when the server goes away or refuses.
        torchheal only: a reference manager server does not serve it.
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
