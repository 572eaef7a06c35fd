"""Moving a replica's state to the peers that are behind, and receiving it from a peer.

:class:`Recovery` is the transfer, as data: :meth:`Recovery.send` hands a state dict to the
checkpoint transport for the replica ranks the quorum assigned to this one, and
:meth:`Recovery.receive` asks the assigned source for its transport metadata and returns the
state dict that arrived. It never touches the user's functions or the Manager's counters: the
Manager decides what to do with what arrived (and when, on the training thread).

The source's metadata is fetched through a callable, so the whole class runs in tests with an
in-memory transport and no servers; :func:`metadata_over_grpc` is the real one.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.checkpointing import CheckpointTransport
from torchheal.checkpointing.timeline import mark
from torchheal.coordination.rpc.channels import aio_connect, serialize
from torchheal.coordination.rpc.errors import rpc_error_to_exception
from torchheal.coordination.types import QuorumResult

__all__ = ["MetadataFetcher", "Recovery", "metadata_over_grpc"]

#: ``(source manager address, this group rank, timeout) -> the source's transport metadata``.
MetadataFetcher = Callable[[str, int, timedelta], str]


def metadata_over_grpc(connect_timeout: timedelta) -> MetadataFetcher:
    """A fetcher that asks the source's ManagerServer (a fresh channel per heal, closed after).

    The call runs on grpc's asyncio stack, on an event loop of its own: the first call of a
    fresh blocking channel completes through grpc's channel-spin thread, which in a busy
    process (training, a process group being rebuilt) was measured handing the answer over
    ~200 ms after it had arrived, its polling period. The asyncio call has no such hand-over.

    Args:
        connect_timeout: how long to try to reach the source's server.
    """

    def fetch(address: str, group_rank: int, timeout: timedelta) -> str:
        return asyncio.run(_fetch_metadata(address, group_rank, timeout, connect_timeout))

    return fetch


async def _fetch_metadata(
    address: str, group_rank: int, timeout: timedelta, connect_timeout: timedelta
) -> str:
    method = methods.MANAGER_CHECKPOINT_METADATA
    channel = await aio_connect(address, connect_timeout)
    try:
        call = channel.unary_unary(
            method.path,
            request_serializer=serialize,
            response_deserializer=method.response.FromString,
        )
        request = pb.CheckpointMetadataRequest(rank=group_rank)
        try:
            response = await call(request, timeout=timeout.total_seconds())
        except grpc.RpcError as e:
            raise rpc_error_to_exception(
                e, f"ManagerService/CheckpointMetadata to {address}"
            ) from None
        return response.checkpoint_metadata
    finally:
        await channel.close()


def _takes_into(method: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False
    return any(p.name == "into" or p.kind is p.VAR_KEYWORD for p in params)


class Recovery:
    """Sends and receives whole state dicts through a checkpoint transport.

    Args:
        transport: the checkpoint transport (HTTP, PG, or an in-memory twin in tests).
        fetch_metadata: how to learn the source's transport metadata.
        group_rank: this rank's index in its replica group (a healer fetches from the same
            group rank of its source).
        timeout: bound on each transfer and on the metadata request.
        log: receives one line per transfer (the Manager's prefixed logger).
    """

    def __init__(
        self,
        transport: CheckpointTransport[Any],
        fetch_metadata: MetadataFetcher,
        group_rank: int,
        timeout: timedelta,
        log: Callable[[str], None],
    ) -> None:
        self._transport = transport
        # Receiving into this replica's own tensors needs a transport that says it can, and
        # whose recv_checkpoint (a subclass may override it) takes ``into``.
        self._in_place = getattr(transport, "receives_in_place", False) is True and _takes_into(
            transport.recv_checkpoint
        )
        self._fetch_metadata = fetch_metadata
        self._group_rank = group_rank
        self._timeout = timeout
        self._log = log
        self._lock = threading.Lock()
        # The receive in flight: its quorum's id and its source's replica id.
        self._receiving: tuple[int, str] | None = None

    def send(self, quorum: QuorumResult, state: dict[str, Any]) -> None:
        """Serves ``state`` to the replica ranks ``quorum`` assigned to this replica.

        Args:
            quorum: this rank's quorum result (``recover_dst_replica_ranks`` non-empty).
            state: the state dict to send, already a private copy.
        """
        destinations = list(quorum.recover_dst_replica_ranks)
        self._log(f"sending checkpoint of step {quorum.max_step} to replica ranks {destinations}")
        self._transport.send_checkpoint(
            dst_ranks=destinations, step=quorum.max_step, state_dict=state, timeout=self._timeout
        )

    def fetch_metadata(self, quorum: QuorumResult) -> str:
        """Asks the assigned source how to reach its state (its transport's metadata).

        Args:
            quorum: this rank's quorum result (``heal`` is True).

        Raises:
            RuntimeError: the quorum names no source.
            Exception: whatever the metadata request raised.
        """
        if quorum.recover_src_replica_rank is None:
            raise RuntimeError("quorum says heal but names no source replica rank")
        mark("metadata.begin")
        metadata = self._fetch_metadata(
            quorum.recover_src_manager_address, self._group_rank, self._timeout
        )
        mark("metadata.end")
        return metadata

    def receive(
        self, quorum: QuorumResult, metadata: str | None = None, into: Any = None
    ) -> dict[str, Any]:
        """Fetches the state of step ``quorum.max_step`` from the assigned source.

        Args:
            quorum: this rank's quorum result (``heal`` is True).
            metadata: the source's metadata when already fetched (:meth:`fetch_metadata`).
            into: this replica's own state, received into where the transport can
                (``receives_in_place``; its failure part way raises ``TornCheckpointError``).

        Returns:
            the received ``{"user": ..., "torchft": ...}`` state dict.

        Raises:
            RuntimeError: the quorum names no source, or what arrived lacks a section.
            Exception: whatever the metadata request or the transport raised.
        """
        source = quorum.recover_src_replica_rank
        if source is None:
            raise RuntimeError("quorum says heal but names no source replica rank")
        address = quorum.recover_src_manager_address
        self._log(f"healing to step {quorum.max_step} from replica rank {source} ({address})")
        if metadata is None:
            metadata = self.fetch_metadata(quorum)
        extra = {"into": into} if into is not None and self._in_place else {}
        ids = quorum.replica_ids
        with self._lock:
            self._receiving = (quorum.quorum_id, ids[source]) if source < len(ids) else None
        try:
            received = self._transport.recv_checkpoint(
                src_rank=source,
                metadata=metadata,
                step=quorum.max_step,
                timeout=self._timeout,
                **extra,
            )
        finally:
            with self._lock:
                self._receiving = None
        if not isinstance(received, dict) or not {"user", "torchft"} <= received.keys():
            raise RuntimeError("received checkpoint lacks the 'user'/'torchft' sections")
        return received

    def on_member_lost(self, replica_id: str, quorum_id: int, reason: str) -> None:
        """The lighthouse says ``replica_id`` of quorum ``quorum_id`` is gone: a receive from
        it (in that quorum or an earlier one) ends now instead of at its timeout.

        Args:
            replica_id: the lost group.
            quorum_id: the quorum it was lost from.
            reason: why (for the log).
        """
        with self._lock:
            receiving = self._receiving
        if receiving is None or receiving[1] != replica_id or receiving[0] > quorum_id:
            return
        self._log(
            f"the source of this heal, {replica_id}, is lost ({reason}): aborting the receive"
        )
        self._transport.abort_receives()
