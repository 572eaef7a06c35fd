"""What a Manager talks to: its replica group's store, the manager server, and a client of it.

:func:`open_endpoints` builds them in the reference's order (§6.1): a client of the replica
group's TCPStore (which torchrun already runs); on group rank 0 the
:class:`~torchheal.coordination.group.server.ManagerServer`, whose address and the group's
full replica id are published in the store; on every rank a
:class:`~torchheal.coordination.clients.manager_client.ManagerClient` of that address.
:class:`GroupEndpoints` then offers the two per-step calls. Group rank 0 owns the server, so it
joins the quorum and votes in-process (the handlers' own coroutines on the server's loop, same
deadlines and errors) instead of a gRPC round trip to itself.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from torch.distributed import TCPStore

from torchheal._base.security import SecurityEnv
from torchheal.coordination.clients.manager_client import ManagerClient
from torchheal.coordination.convert import notice_from_pb
from torchheal.coordination.group.server import ManagerServer
from torchheal.coordination.rpc.addresses import format_target
from torchheal.coordination.types import Notice, QuorumAsk, QuorumResult
from torchheal.process_group.store import connect_store

__all__ = [
    "MANAGER_ADDR_KEY",
    "REPLICA_ID_KEY",
    "GroupEndpoints",
    "client_class",
    "metadata_through",
    "open_endpoints",
]

logger: logging.Logger = logging.getLogger(__name__)

#: A rank whose watch of its manager server broke waits this long before watching again.
WATCH_RETRY_S = 0.5
#: How long a rank's report of a build it gave up may take (it is best effort).
GAVE_UP_TIMEOUT = timedelta(seconds=5)

MANAGER_ADDR_KEY: str = "manager_addr"
REPLICA_ID_KEY: str = "replica_id"
#: ``"{session}{joined_running}"`` as two "0"/"1" characters, published by group rank 0 so every
#: rank of the group takes the same decisions (background transfers, a warm-up step).
LIGHTHOUSE_MODE_KEY: str = "torchheal_lighthouse_mode"
#: The last quorum id the group built a process group for, kept in its store (which outlives
#: restarts of the group): reported so a restarted lighthouse never issues one of those ids again.
LAST_QUORUM_KEY: str = "torchheal_last_quorum_id"


@dataclass
class GroupEndpoints:
    """The open connections of one rank of one replica group.

    Args:
        store: client of the replica group's TCPStore.
        server: the group's manager server (group rank 0 only, else None).
        client: client of the group's manager server (every rank; rank 0 uses it only to
            check at start-up that the published address works).
        replica_id: the group's full id (``"{name}:{uuid}"``), read from the store.
        session_mode: the lighthouse is torchheal's (a session), not the reference's.
        joined_running: the lighthouse had issued a quorum before this group said hello: the
            job was already running when this group (re)started.
        reference_client: ``client`` is not torchheal's own (``torchheal.manager.ManagerClient``
            was replaced): it is spoken to with the reference's methods only.
    """

    store: TCPStore
    server: ManagerServer | None
    client: ManagerClient
    replica_id: str
    session_mode: bool = False
    joined_running: bool = False
    reference_client: bool = False
    _closed: threading.Event = field(default_factory=threading.Event)

    def quorum(self, ask: QuorumAsk) -> QuorumResult:
        """This rank's part of the quorum round (see ``ManagerClient.quorum``).

        Args:
            ask: the rank's request.
        """
        if self.server is not None:
            return self.server.quorum_in_process(ask)
        if self.reference_client:
            # A replaced client is spoken to with the reference's method only.
            return self.client._quorum(
                group_rank=ask.group_rank,
                step=ask.step,
                checkpoint_metadata=ask.checkpoint_metadata,
                shrink_only=ask.shrink_only,
                init_sync=ask.init_sync,
                commit_failures=ask.commit_failures,
                timeout=ask.timeout,
            )
        return self.client.quorum(ask)

    def start_quorum(self, ask: QuorumAsk) -> concurrent.futures.Future[QuorumResult] | None:
        """:meth:`quorum` without waiting, where the server lives in this process (rank 0).

        Returns the future answer (settled on the server's loop thread), or None on the other
        ranks, which ask with the blocking :meth:`quorum`.

        Args:
            ask: the rank's request.
        """
        if self.server is None:
            return None
        return self.server.start_quorum_in_process(ask)

    def vote(
        self,
        group_rank: int,
        step: int,
        should_commit: bool,
        timeout: timedelta,
        salvageable: bool = False,
    ) -> tuple[bool, bool]:
        """This rank's commit vote; returns the group's decision as ``(commit, redo)``.

        Args:
            group_rank: this rank's index in the group.
            step: the step voted on.
            should_commit: this rank's vote.
            timeout: deadline of the vote.
            salvageable: with a "no": a redo of the step would cure this rank's failure.
        """
        if self.server is not None:
            call = self.server.vote_in_process
        elif self.reference_client:
            # The reference's vote has no salvage: the group never redoes a step.
            return self.client.should_commit(
                group_rank, step, should_commit, timeout=timeout
            ), False
        else:
            call = self.client.vote
        return call(group_rank, step, should_commit, salvageable, timeout)

    def gave_up(self, quorum_id: int, reason: str) -> None:
        """This rank gave up building quorum ``quorum_id``'s process group: the lighthouse
        tells the other groups, whose builds wait for this rank's address (a torchheal
        lighthouse only). Best effort: a failure is logged, and the others then wait for their
        timeout, as before.

        Args:
            quorum_id: the quorum whose build failed.
            reason: why (passed on to the other groups' logs).
        """
        if not self.session_mode:
            return
        try:
            if self.server is not None:
                self.server.report_gave_up(quorum_id, reason)
            else:
                self.client.gave_up(quorum_id, reason, GAVE_UP_TIMEOUT)
        except Exception as e:
            logger.warning(f"could not report the build of quorum {quorum_id} given up: {e}")

    def watch_lost(self, group_rank: int, listener: Callable[[Notice], None]) -> None:
        """Calls ``listener(notice)`` for every lost-member notice, decoded as this group hears
        it (``convert.notice_from_pb``).

        Group rank 0 hears notices in-process; other ranks watch the server over gRPC on a
        daemon thread until :meth:`close`. Nothing arrives with a reference lighthouse.

        Args:
            group_rank: this rank's index in the group.
            listener: quick and thread-safe (it runs on the server's or the watch thread).
        """
        if self.server is not None:
            self.server.add_lost_listener(listener)
            return

        def watch() -> None:
            while not self._closed.is_set():
                try:
                    for lost in self.client.watch(group_rank):
                        listener(notice_from_pb(lost, self.replica_id))
                except Exception as e:
                    if self._closed.is_set():
                        return
                    logger.debug("watching the manager server broke (%s); watching again", e)
                self._closed.wait(WATCH_RETRY_S)

        threading.Thread(target=watch, name="torchheal-notices", daemon=True).start()

    def healed(self) -> None:
        """Group rank 0: this rank loaded a peer's state; the group holds that quorum's history
        (its session says so to the lighthouse with its next request, ``quorum.superseded``)."""
        if self.server is not None:
            self.server.healed()

    def record_quorum(self, quorum_id: int) -> None:
        """Group rank 0: record in the store that the group builds a process group for
        ``quorum_id`` (before the build writes any key under its prefix).

        Args:
            quorum_id: the quorum about to be built.
        """
        if self.server is not None:
            self.store.set(LAST_QUORUM_KEY, str(quorum_id))

    def close(self) -> None:
        """Closes the client and stops the server (the store client closes with the object)."""
        self._closed.set()
        self.client.close()
        if self.server is not None:
            self.server.shutdown()


def client_class() -> type[ManagerClient]:
    """The manager client class ranks build: ``torchheal.manager.ManagerClient``, read from the
    package at call time so that replacing it there (as the reference's tests patch
    ``torchft.manager.ManagerClient``) takes effect; this module cannot import its own package.
    """
    package = sys.modules.get(__package__ or "")
    return getattr(package, "ManagerClient", ManagerClient)


def metadata_through(
    client_cls: type[ManagerClient], connect_timeout: timedelta
) -> Callable[[str, int, timedelta], str]:
    """A metadata fetcher (``recovery.MetadataFetcher``) that asks the source's server with
    ``client_cls``'s ``_checkpoint_metadata``, as the reference does: used when
    ``torchheal.manager.ManagerClient`` was replaced, so the replacement answers.

    Args:
        client_cls: the client class to build per fetch.
        connect_timeout: how long to try to reach the source's server.
    """

    def fetch(address: str, group_rank: int, timeout: timedelta) -> str:
        client = client_cls(address, connect_timeout=connect_timeout)
        try:
            return client._checkpoint_metadata(group_rank, timeout=timeout)
        finally:
            client.close()

    return fetch


def open_endpoints(
    *,
    group_rank: int,
    group_world_size: int,
    store_host: str,
    store_port: int,
    lighthouse_addr: str | None,
    replica_name: str | None,
    port: int,
    hostname: str,
    heartbeat_interval: timedelta,
    connect_timeout: timedelta,
    quorum_retries: int,
    id_suffix: str | None = None,
    security: SecurityEnv,
) -> GroupEndpoints:
    """Connects to the group's store; group rank 0 starts the manager server; all connect to it.

    Args:
        group_rank: this rank's index in its replica group.
        group_world_size: the group's number of ranks.
        store_host: host of the group's TCPStore.
        store_port: its port.
        lighthouse_addr: the lighthouse (needed on group rank 0 only).
        replica_name: the group's name; a fresh uuid is appended so a fast restart never
            reuses an id.
        port: group rank 0's server port (0: ephemeral).
        hostname: the host name advertised to other groups.
        heartbeat_interval: how often the server heartbeats the lighthouse.
        connect_timeout: reaching the lighthouse and the server.
        quorum_retries: lighthouse quorum retries inside the server.
        id_suffix: the uuid appended to the name (group rank 0; a fresh ``uuid4`` when None):
            the Manager's carries its divergence guard settings
            (:func:`~torchheal.manager.divergence.advertise`).
        security: the Manager's job token and TLS settings, for its server and its client
            (a replaced client class is built as the reference's, without them).

    Raises:
        ValueError: group rank 0 has no lighthouse address.
    """
    # The store client outlives rank 0's server start-up (bounded by connect_timeout). Its
    # connection ends at its timeout even when the store's host is frozen (c10d's own does not).
    store = connect_store(store_host, store_port, max(timedelta(seconds=300), 2 * connect_timeout))
    server = None
    if group_rank == 0:
        if not lighthouse_addr:
            raise ValueError(
                "no lighthouse address: pass lighthouse_addr or set TORCHHEAL_LIGHTHOUSE "
                "(or TORCHFT_LIGHTHOUSE)"
            )
        suffix = id_suffix or str(uuid.uuid4())
        full_id = f"{replica_name}:{suffix}" if replica_name else suffix
        last_quorum_id = 0
        if store.check([LAST_QUORUM_KEY]):
            last_quorum_id = int(store.get(LAST_QUORUM_KEY).decode("ascii") or 0)
        server = ManagerServer(
            replica_id=full_id,
            lighthouse_addr=lighthouse_addr,
            hostname=hostname,
            bind=f"[::]:{port}",
            store_addr=format_target(store_host, store_port),
            world_size=group_world_size,
            heartbeat_interval=heartbeat_interval,
            connect_timeout=connect_timeout,
            quorum_retries=quorum_retries,
            last_quorum_id=last_quorum_id,
            security=security,
        )
        mode = f"{int(server.session_mode)}{int(server.joined_running_job)}"
        store.set(LIGHTHOUSE_MODE_KEY, mode)  # before the address, which the others wait for
        store.set(MANAGER_ADDR_KEY, server.address())
        store.set(REPLICA_ID_KEY, full_id)
    client_cls = client_class()
    try:
        address = store.get(MANAGER_ADDR_KEY).decode("utf-8")
        if client_cls is ManagerClient:
            client = ManagerClient(address, connect_timeout=connect_timeout, security=security)
        else:  # the reference's signature: a replacement may not take torchheal's settings
            client = client_cls(address, connect_timeout=connect_timeout)
        replica_id = store.get(REPLICA_ID_KEY).decode("utf-8")
        # A torchheal rank 0 sets the mode before the address, so it is there by now; a
        # reference rank 0 never sets it (its group runs as the reference's would).
        mode = "00"
        if store.check([LIGHTHOUSE_MODE_KEY]):
            mode = store.get(LIGHTHOUSE_MODE_KEY).decode("utf-8")
    except BaseException:
        if server is not None:
            server.shutdown()
        raise
    return GroupEndpoints(
        store=store,
        server=server,
        client=client,
        replica_id=replica_id,
        session_mode=mode[:1] == "1",
        joined_running=mode[1:2] == "1",
        reference_client=client_cls is not ManagerClient,
    )
