"""Wiring the Manager's parts: endpoints, logger, telemetry and the quorum thread's worker.

:func:`build_parts` opens the group's endpoints and builds what talks to them, closing what it
opened if a later part (telemetry) fails to start. It also makes the two decisions that depend on
the lighthouse's hello, which the Manager only reads: heal beside the step's collectives (an
asynchronous quorum, a transport that ``runs_beside_collectives`` and a torchheal lighthouse,
since a reference one drops a healer that is late by design), and warm up first (an asynchronous
quorum, joining a job already running). Transports are duck-typed, so their flags are read with
``getattr``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torchheal.checkpointing.transport import CheckpointTransport
from torchheal.coordination.plan import WorldSizeMode
from torchheal.manager.divergence import FORMAT, advertise, advertised
from torchheal.manager.endpoints import (
    GroupEndpoints,
    client_class,
    metadata_through,
    open_endpoints,
)
from torchheal.manager.failfast import ConnectedQuorum
from torchheal.manager.guard import DivergenceGuard, guard_settings
from torchheal.manager.heal import HealHost, HealStep
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import StepMachine
from torchheal.manager.quorum_thread import QuorumThread
from torchheal.manager.quorum_worker import QuorumOutcome, QuorumWorker
from torchheal.manager.recovery import Recovery, metadata_over_grpc
from torchheal.manager.salvage import Salvage
from torchheal.manager.settings import ManagerSettings
from torchheal.manager.state import StateRegistry
from torchheal.manager.step import StepLedger
from torchheal.manager.telemetry import Telemetry

__all__ = ["ManagerParts", "build_parts", "copies_state", "needs_no_snapshot"]


def copies_state(transport: CheckpointTransport[Any]) -> bool:
    """Whether ``transport`` stages its own copy of the state it sends (``copies_state``).

    ``is True`` here and at every read of a capability: a mocked transport (the reference's
    tests use ``MagicMock(spec=CheckpointTransport)``) answers each with a truthy mock.

    Args:
        transport: a checkpoint transport.
    """
    return transport.copies_state is True


def needs_no_snapshot(transport: CheckpointTransport[Any]) -> bool:
    """Whether ``transport`` keeps what it sends intact itself: it copies the state when it
    sends it (``copies_state``) or before it may change (``copies_on_write``).

    Args:
        transport: a checkpoint transport.
    """
    return copies_state(transport) or transport.copies_on_write is True


@dataclass
class ManagerParts:
    """What :func:`build_parts` made for one Manager.

    Args:
        endpoints: the group's store, server (group rank 0) and client.
        logger: the per-rank prefixed logger.
        telemetry: metrics and structured records.
        worker: the quorum thread's work.
        recovery: the transfers (the worker's), told when a heal's source is lost.
        background_transfer: heal beside the step's collectives.
        machine: the step machine (it decides; the parts below do).
        ledger: the step's errors and outstanding work.
        quorums: the quorum thread.
        heal: the heal on the training thread.
        connected: the fail-fast aborts.
        salvage: the redo of a step a group died in.
        guard: the divergence guard.
    """

    endpoints: GroupEndpoints
    logger: ManagerLogger
    telemetry: Telemetry
    worker: QuorumWorker
    recovery: Recovery
    background_transfer: bool
    machine: StepMachine
    ledger: StepLedger
    quorums: QuorumThread
    heal: HealStep
    connected: ConnectedQuorum
    salvage: Salvage
    guard: DivergenceGuard


def build_parts(
    settings: ManagerSettings,
    *,
    transport: CheckpointTransport[Any],
    state: StateRegistry,
    process_group: Callable[[], Any],
    host: HealHost,
    apply_outcome: Callable[[QuorumOutcome], None],
    replica_name: str | None,
    hostname: str,
    heartbeat_interval: timedelta,
    use_async_quorum: bool,
    init_sync: bool,
    world_size_mode: WorldSizeMode,
    min_replica_size: int,
    max_retries: int | None,
    salvage: bool,
    guard: tuple[int | None, str | None],
) -> ManagerParts:
    """Opens the group's endpoints and builds the parts that use them.

    Args:
        settings: the Manager's resolved settings.
        transport: the checkpoint transport.
        state: the user's state functions and their lock.
        process_group: returns the Manager's current cross-replica process group.
        host: the Manager (a heal reports its failures to it).
        apply_outcome: takes in what a step's quorum work produced (the quorum thread's).
        replica_name: the user's replica id (None: a uuid alone).
        hostname: the host name advertised to other groups.
        heartbeat_interval: how often the manager server heartbeats the lighthouse.
        use_async_quorum: the quorum runs during the forward pass.
        init_sync: heal replicas at step 0 so all start identical.
        world_size_mode: DYNAMIC or FIXED_WITH_SPARES.
        min_replica_size: fewest participating replicas with which a step may commit.
        max_retries: failed commits in a row tolerated (None: no limit).
        salvage: ``salvage_step``.
        guard: the Manager's ``divergence_check_interval`` and ``on_divergence`` (resolved by
            :func:`~torchheal.manager.guard.guard_settings`; group rank 0 advertises them in the
            group's replica id).
    """
    timeouts = settings.timeouts
    guard_set = guard_settings(*guard)
    endpoints = open_endpoints(
        group_rank=settings.group_rank,
        group_world_size=settings.group_world_size,
        store_host=settings.store_host,
        store_port=settings.store_port,
        lighthouse_addr=settings.lighthouse_addr,
        replica_name=replica_name,
        port=settings.port,
        hostname=hostname,
        heartbeat_interval=heartbeat_interval,
        connect_timeout=timeouts.connect_timeout,
        quorum_retries=timeouts.quorum_retries,
        id_suffix=advertise(guard_set, uuid.uuid4().int),
        security=settings.security,
    )
    machine = StepMachine(
        min_replica_size=min_replica_size,
        max_retries=max_retries,
        salvage=salvage,
        warmup=use_async_quorum and endpoints.joined_running,
    )
    logger = ManagerLogger(lambda: machine.step, endpoints.replica_id, settings.group_rank)
    try:
        # Metrics (group rank 0, when TORCHHEAL_METRICS_PORT is set) and structured records.
        telemetry = Telemetry(
            replica_name, endpoints.replica_id, settings.group_rank, hostname=hostname
        )
    except BaseException:
        endpoints.close()
        raise
    copies = needs_no_snapshot(transport)
    fetch_metadata = metadata_over_grpc(timeouts.connect_timeout, settings.security)
    if endpoints.reference_client:
        fetch_metadata = metadata_through(client_class(), timeouts.connect_timeout)
    recovery = Recovery(
        transport,
        fetch_metadata,
        settings.group_rank,
        timeouts.timeout,
        logger.info,
    )
    worker = QuorumWorker(
        quorum_call=endpoints.quorum,
        quorum_start=endpoints.start_quorum,
        record_quorum=endpoints.record_quorum,
        process_group=process_group,
        recovery=telemetry.recovery(recovery),
        # A transport that copies the state itself (or copies on write) needs no copy of ours,
        # only the read lock around its staging (DiLoCo/LocalSGD block reads while they change
        # the state).
        snapshot=(lambda captured: captured) if copies else state.copy,
        send_guard=state.lock.r_lock if copies else nullcontext,
        metadata=transport.metadata,
        group_rank=settings.group_rank,
        replica_name=replica_name,
        use_async_quorum=use_async_quorum,
        init_sync=init_sync,
        world_size_mode=world_size_mode,
        min_replica_size=min_replica_size,
        log=logger,
        group_world_size=settings.group_world_size,
        # Group rank 0 speaks for the group; a group with the guard off has nothing to say.
        member_data=(
            telemetry.guard_report
            if settings.group_rank == 0 and guard_set.interval
            else lambda: None
        ),
    )
    ledger = StepLedger(logger, telemetry.error)
    heal = HealStep(
        host=host,
        machine=machine,
        load_user=state.load,
        timeout=timeouts.timeout,
        waited=telemetry.waited,
        log=logger,
        healed=endpoints.healed,
    )
    connected = ConnectedQuorum(
        process_group, logger, telemetry.process_group_aborted, gave_up=endpoints.gave_up
    )
    worker.guard_builds(connected.building)
    if advertised(endpoints.replica_id) not in (None, (FORMAT, guard_set)):
        logger.warning(
            f"this rank's divergence guard settings ({guard_set}) differ from its group rank 0's "
            f"({endpoints.replica_id}): the group runs with rank 0's"
        )
    divergence = DivergenceGuard(
        guard_set,
        machine=machine,
        quorum=lambda: heal.quorum,
        # What a healer would receive (the user's state, the Manager's counters), and what
        # the user registered for comparison only.
        read_state=lambda: {
            **state.read_compared(
                lambda: {"step": machine.step, "batches_committed": machine.batches_committed}
            ),
            "compared": {key: fn() for key, fn in state.fingerprinted.items()},
        },
        can_read=lambda: not state.empty and state.reads_allowed,
        process_group=process_group,
        broken=lambda: ledger.skipped > 0 or connected.aborted_for is not None,
        # Not the loop's own error: a salvage or a drop reads the step's failure as it is.
        fail=lambda e: ledger.fail(e, how="the divergence guard's exchange failed"),
        expiry=lambda: connected.expiry,
        timeout=timeouts.timeout,
        log=logger,
        stats=telemetry.stats,
    )
    return ManagerParts(
        endpoints=endpoints,
        logger=logger,
        telemetry=telemetry,
        worker=worker,
        recovery=recovery,
        background_transfer=(
            use_async_quorum
            and transport.runs_beside_collectives is True
            and endpoints.session_mode
        ),
        machine=machine,
        ledger=ledger,
        quorums=QuorumThread(worker, apply_outcome, telemetry),
        heal=heal,
        connected=connected,
        salvage=Salvage(
            machine=machine,
            connected=connected,
            ledger=ledger,
            heal=heal,
            log=logger,
            salvaged=telemetry.salvaged,
        ),
        guard=divergence,
    )
