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
import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import grpc

from torchheal._base.security import SecurityEnv
from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.checkpointing import CheckpointTransport
from torchheal.checkpointing.timeline import mark
from torchheal.coordination.rpc.channels import aio_connect, serialize
from torchheal.coordination.rpc.errors import rpc_error_to_exception
from torchheal.coordination.types import QuorumResult

__all__ = ["MetadataFetcher", "Recovery", "SourceLostError", "metadata_over_grpc"]

#: ``(source manager address, this group rank, timeout) -> the source's transport metadata``.
#: A fetcher that also takes ``cancelled`` (a ``threading.Event``) gives the request up once it
#: is set: the lighthouse said the source is gone.
MetadataFetcher = Callable[[str, int, timedelta], str]


class SourceLostError(RuntimeError):
    """The source of a heal was lost while its metadata was being fetched."""


def metadata_over_grpc(connect_timeout: timedelta, security: SecurityEnv) -> MetadataFetcher:
    """A fetcher that asks the source's ManagerServer (a fresh channel per heal, closed after).

    The call runs on grpc's asyncio stack, on an event loop of its own: a fresh blocking
    channel's first answer can arrive a polling period late in a busy process (docs/failures.md).

    Args:
        connect_timeout: how long to try to reach the source's server.
        security: the job token and TLS settings of the channel (the Manager's).
    """

    def fetch(
        address: str,
        group_rank: int,
        timeout: timedelta,
        cancelled: threading.Event | None = None,
    ) -> str:
        request = _fetch_metadata(address, group_rank, timeout, connect_timeout, security)
        if cancelled is None:
            return asyncio.run(request)
        return asyncio.run(_unless(request, cancelled, address))

    return fetch


#: How often a metadata request looks whether it was given up.
_CANCEL_POLL_S = 0.02
#: Lost groups a Recovery remembers (a notice may come before the heal from that group).
_REMEMBERED_LOST = 16


async def _unless(request: Any, cancelled: threading.Event, address: str) -> str:
    """Awaits ``request`` unless ``cancelled`` is set first. A source that froze accepts the
    connection and never answers, so its request would last the connect timeout."""
    task = asyncio.ensure_future(request)
    while not task.done():
        if cancelled.is_set():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            # The closed channel's last completion comes from grpc's poller thread: let it land
            # on this loop, not on a closed one ("Event loop is closed").
            await asyncio.sleep(_CANCEL_POLL_S)
            raise SourceLostError(
                f"the metadata request to {address} was given up: the lighthouse says its "
                "group is lost"
            )
        await asyncio.wait({task}, timeout=_CANCEL_POLL_S)
    return task.result()


async def _fetch_metadata(
    address: str,
    group_rank: int,
    timeout: timedelta,
    connect_timeout: timedelta,
    security: SecurityEnv,
) -> str:
    method = methods.MANAGER_CHECKPOINT_METADATA
    channel = await aio_connect(address, connect_timeout, security)
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


def _takes(method: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


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
        self.transport = transport
        # Receiving into this replica's own tensors needs a transport that says it can, and
        # whose recv_checkpoint (a subclass may override it) takes ``into``.
        self._in_place = transport.receives_in_place is True and _takes(
            transport.recv_checkpoint, "into"
        )
        self._fetch_metadata = fetch_metadata
        self._cancellable = _takes(fetch_metadata, "cancelled")
        self._group_rank = group_rank
        self._timeout = timeout
        self._log = log
        self._lock = threading.Lock()
        # The heal in flight (its metadata request, then its receive): its quorum's id, its
        # source's replica id, and what is set when the lighthouse says that source is lost.
        self._receiving: tuple[int, str, threading.Event] | None = None
        # The last groups the lighthouse said were lost, with the latest quorum they were lost
        # from: a heal from one of them that starts after the notice is given up at once.
        self._lost: dict[str, int] = {}

    def send(self, quorum: QuorumResult, state: dict[str, Any]) -> None:
        """Serves ``state`` to the replica ranks ``quorum`` assigned to this replica.

        Args:
            quorum: this rank's quorum result (``recover_dst_replica_ranks`` non-empty).
            state: the state dict to send, already a private copy.
        """
        destinations = list(quorum.recover_dst_replica_ranks)
        self._log(f"sending checkpoint of step {quorum.max_step} to replica ranks {destinations}")
        self.transport.send_checkpoint(
            dst_ranks=destinations, step=quorum.max_step, state_dict=state, timeout=self._timeout
        )

    def fetch_metadata(self, quorum: QuorumResult) -> str:
        """Asks the assigned source how to reach its state (its transport's metadata).

        Args:
            quorum: this rank's quorum result (``heal`` is True).

        Raises:
            RuntimeError: the quorum names no source.
            SourceLostError: the lighthouse said the source is lost before it answered.
            Exception: whatever the metadata request raised.
        """
        with self._healing_from(quorum) as lost:
            return self._fetch(quorum, lost)

    def _fetch(self, quorum: QuorumResult, lost: threading.Event) -> str:
        address = quorum.recover_src_manager_address
        if lost.is_set():
            raise SourceLostError(f"the source of this heal ({address}) is already lost")
        mark("metadata.begin")
        extra = {"cancelled": lost} if self._cancellable else {}
        metadata = self._fetch_metadata(address, self._group_rank, self._timeout, **extra)
        mark("metadata.end")
        return metadata

    @contextlib.contextmanager
    def _healing_from(self, quorum: QuorumResult) -> Iterator[threading.Event]:
        """Registers the heal from ``quorum``'s source for :meth:`on_member_lost`."""
        source = quorum.recover_src_replica_rank
        if source is None:
            raise RuntimeError("quorum says heal but names no source replica rank")
        ids = quorum.replica_ids
        lost = threading.Event()
        with self._lock:
            before = self._receiving
            if source < len(ids):
                self._receiving = (quorum.quorum_id, ids[source], lost)
                if self._lost.get(ids[source], -1) >= quorum.quorum_id:
                    lost.set()  # the notice came first
        try:
            yield lost
        finally:
            with self._lock:
                self._receiving = before

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
        extra = {"into": into} if into is not None and self._in_place else {}
        with self._healing_from(quorum) as lost:
            if metadata is None:
                metadata = self._fetch(quorum, lost)
            if lost.is_set():
                raise SourceLostError(f"the source of this heal ({address}) is lost")
            received = self.transport.recv_checkpoint(
                src_rank=source,
                metadata=metadata,
                step=quorum.max_step,
                timeout=self._timeout,
                **extra,
            )
        if not isinstance(received, dict) or not {"user", "torchft"} <= received.keys():
            raise RuntimeError("received checkpoint lacks the 'user'/'torchft' sections")
        return received

    def on_member_lost(self, replica_id: str, quorum_id: int, reason: str) -> None:
        """The lighthouse says ``replica_id`` of quorum ``quorum_id`` is gone: a heal from it
        (in that quorum or an earlier one) ends now instead of at its timeout, its metadata
        request or its receive, and one that starts later ends at once.

        Args:
            replica_id: the lost group.
            quorum_id: the quorum it was lost from.
            reason: why (for the log).
        """
        with self._lock:
            self._lost[replica_id] = max(quorum_id, self._lost.get(replica_id, -1))
            while len(self._lost) > _REMEMBERED_LOST:
                del self._lost[next(iter(self._lost))]
            receiving = self._receiving
        if receiving is None or receiving[1] != replica_id or receiving[0] > quorum_id:
            return
        self._log(
            f"the source of this heal, {replica_id}, is lost ({reason}): aborting the receive"
        )
        receiving[2].set()
        self.transport.abort_receives()
