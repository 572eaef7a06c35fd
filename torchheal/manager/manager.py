"""The :class:`Manager`: the per-step fault-tolerance lifecycle on every rank (reference §6).

When a step commits, and what a lighthouse notice does, is decided by the pure step machine
(:mod:`torchheal.manager.machine`); the Manager drives it and does what it says with parts that
each do one job (built by :func:`~torchheal.manager.build.build_parts`): the quorum thread, the
heal (:class:`~torchheal.manager.heal.HealStep`: the transfer and the load, on the training
thread only, a deliberate difference from the reference), the fail-fast aborts
(:class:`~torchheal.manager.failfast.ConnectedQuorum`) and the salvage of a step a group died in
(:mod:`torchheal.manager.salvage`). ``docs/architecture.md`` ("The step machine") lists the
rules and their invariants.

Errors: a quorum RPC error and a ``should_commit`` RPC error are raised; any other failure in a
step (reconfiguration, transfer, a collective) is reported and makes the step not commit.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from torchheal._base import manager_env
from torchheal.checkpointing import CheckpointTransport, HTTPTransport
from torchheal.coordination.plan import Participation, WorldSizeMode
from torchheal.coordination.types import Notice
from torchheal.manager.allreduce import IS_TRITON_AVAILABLE, ManagerCollectives
from torchheal.manager.build import build_parts, copies_state
from torchheal.manager.machine import EndHeal
from torchheal.manager.quorum_worker import QuorumOutcome, StepRequest
from torchheal.manager.settings import ManagerSettings
from torchheal.manager.state import ManagerUserState, StateRegistry
from torchheal.manager.views import ReferenceViews

__all__ = ["IS_TRITON_AVAILABLE", "Manager"]

T = TypeVar("T")


class Manager(ManagerCollectives, ManagerUserState, ReferenceViews):
    """Manages the fault-tolerant training loop of one rank of one replica group.

    The replica group's TCPStore must already run at ``store_addr:store_port`` (torchrun
    provides it); group rank 0 starts the ManagerServer and publishes its address there.
    Save and restore ``Manager.state_dict()`` with the user state for periodic checkpoints.

    Args:
        pg: the cross-replica process group (reconfigured on every new quorum).
        load_state_dict: loads the user state received when healing (training thread only).
        state_dict: returns the user state to send to a healing peer (training thread only).
        min_replica_size: fewest participating replicas with which a step may commit.
        use_async_quorum: run the quorum in the background during the forward pass.
        timeout: collectives, should_commit, checkpoint transfer, state-dict lock, wrap_future.
        quorum_timeout: how long a quorum may take (longer than a step; see the budget warning).
        connect_timeout: establishing RPC connections to the ManagerServer and lighthouse.
        rank: group rank (``RANK`` when None).
        world_size: group world size (``WORLD_SIZE`` when None).
        world_size_mode: DYNAMIC or FIXED_WITH_SPARES.
        store_addr: the replica group's TCPStore host (``MASTER_ADDR`` when None).
        store_port: the replica group's TCPStore port (``MASTER_PORT`` when None).
        lighthouse_addr: group rank 0: the lighthouse (``TORCHHEAL_LIGHTHOUSE`` /
            ``TORCHFT_LIGHTHOUSE`` when None).
        replica_id: group rank 0: this replica group's name (a uuid is appended).
        port: group rank 0: ManagerServer port (``*_MANAGER_PORT`` env, else ephemeral).
        hostname: group rank 0: the host name advertised to peers.
        heartbeat_interval: how often the ManagerServer heartbeats the lighthouse.
        checkpoint_transport: moves state to healing peers (HTTPTransport when None).
        init_sync: synchronise weights from a primary at step 0 (False if seeded identically).
        max_retries: consecutive failed commits tolerated before ``should_commit`` raises.
        quorum_retries: lighthouse quorum retries in the ManagerServer.
        salvage_step: when a replica group is lost during a step, redo the step's allreduces
            in a new quorum instead of skipping the step (:mod:`torchheal.manager.salvage`:
            what it costs and what it asks of the training loop). Every rank of a group must
            pass the same. ``TORCHHEAL_SALVAGE_STEP=1`` when None; off by default, as the
            reference.
        divergence_check_interval: compare the groups' state every this many steps, after heals
            and new quorums, in quorums whose groups all use the same (``docs/divergence.md``);
            0: off; None: ``TORCHHEAL_DIVERGENCE_CHECK_INTERVAL``, else 100 (the default).
        on_divergence: ``repair``, ``stop`` or ``warn`` (``TORCHHEAL_ON_DIVERGENCE`` or repair).
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[T], None] | None,
        state_dict: Callable[[], T] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: CheckpointTransport[dict[str, T]] | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        salvage_step: bool | None = None,
        divergence_check_interval: int | None = None,
        on_divergence: str | None = None,
    ) -> None:
        settings = ManagerSettings.resolve(
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout,
            quorum_retries=quorum_retries,
            heartbeat_interval=heartbeat_interval,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse_addr,
            port=port,
        )
        timeouts = settings.timeouts
        self._timeout, self._quorum_timeout = timeouts.timeout, timeouts.quorum_timeout
        self._connect_timeout = timeouts.connect_timeout
        self._quorum_retries = timeouts.quorum_retries
        self._group_rank, self._group_world_size = settings.group_rank, settings.group_world_size

        self._state = StateRegistry(lock_timeout=self._timeout)
        self._replica_id = replica_id
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum

        if checkpoint_transport is None:
            checkpoint_transport = HTTPTransport(
                timeout=self._timeout, num_chunks=0, security=settings.security
            )

        self._pg = pg
        parts = build_parts(
            settings,
            transport=checkpoint_transport,
            state=self._state,
            process_group=lambda: self._pg,
            host=self,
            apply_outcome=self._apply_outcome,
            replica_name=replica_id,
            hostname=hostname,
            heartbeat_interval=heartbeat_interval,
            use_async_quorum=use_async_quorum,
            init_sync=init_sync,
            world_size_mode=world_size_mode,
            min_replica_size=min_replica_size,
            max_retries=max_retries,
            salvage=manager_env.salvage_step() if salvage_step is None else salvage_step,
            guard=(divergence_check_interval, on_divergence),
        )
        self._endpoints, self._logger = parts.endpoints, parts.logger
        self._telemetry = parts.telemetry
        self._worker, self._recovery, self._quorums = parts.worker, parts.recovery, parts.quorums
        self._machine, self._ledger, self._heal = parts.machine, parts.ledger, parts.heal
        self._connected, self._salvage, self._guard = parts.connected, parts.salvage, parts.guard
        self._background_transfer = parts.background_transfer
        self._full_replica_id: str = self._endpoints.replica_id
        self._endpoints.watch_lost(self._group_rank, self._on_notice)

    def _on_notice(self, notice: Notice) -> None:
        """Does what a lighthouse notice does (decided by ``machine.Connection.on_notice``)."""
        self._connected.on_notice(notice, self._end_heal, self._machine.step)

    def _end_heal(self, end: EndHeal) -> None:
        self._recovery.on_member_lost(end.replica_id, end.quorum_id, end.reason)

    @property
    def salvage_step(self) -> bool:
        """Whether a step a replica group dies in is redone without it (``salvage_step``)."""
        return self._machine.salvage

    # -- step lifecycle -----------------------------------------------------------------

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: timedelta | None = None,
    ) -> None:
        """Begins a step: computes a quorum (in the background unless synchronous) and heals.

        All replicas must pass the same ``allow_heal``.

        Args:
            allow_heal: send/receive state to/from peers that are behind this step.
            shrink_only: ask the lighthouse not to admit new replicas this step.
            timeout: quorum timeout for this step (``quorum_timeout`` when None).

        Raises:
            TimeoutError, RuntimeError: the quorum RPC failed (synchronous quorum, or a previous
                quorum error nobody has observed yet).
        """
        self._quorums.raise_unobserved()
        self._heal.drain()  # the last step's transfer, if its should_commit never came
        self._ledger.begin()
        self._salvage.kept.begin()
        if self._heal.begin():  # the warm-up (see torchheal.manager.heal): no quorum
            self._quorums.skip()
            return
        self._quorums.submit(self._step_request(allow_heal, shrink_only, timeout))
        if not self._use_async_quorum:
            self.wait_quorum()
            if self._healing:
                # Load before the forward pass; this replica then contributes like the others.
                self._apply_pending_state_dict()
                self._healing = False

    def _step_request(
        self, allow_heal: bool, shrink_only: bool, timeout: timedelta | None
    ) -> StepRequest:
        """This step's quorum request (captures the state a healing peer would receive)."""
        # Captured on this (the training) thread.
        captured = self._capture_state_dict() if allow_heal else None
        machine = self._machine
        return StepRequest(
            step=machine.step,
            commit_failures=machine.commit_failures,
            current_quorum_id=self._quorum_id,
            allow_heal=allow_heal,
            shrink_only=shrink_only,
            timeout=timeout or self._quorum_timeout,
            captured=captured,
            device=torch.cuda.current_device() if torch.cuda.is_available() else -1,
            can_load=not self._state.empty,
            background=self._background_transfer,
            # Nothing worth keeping (never committed): a heal receives into its own tensors.
            heal_in_place=machine.step == 0 and machine.batches_committed == 0,
        )

    def _requorum(self) -> None:
        """A new quorum of the same step, nobody admitted (a salvage's redo)."""
        self._quorums.submit(self._step_request(True, True, None))
        self.wait_quorum()

    def skip_warmup(self) -> None:
        """Joins the quorum at the first step even when the job is already running.

        For training loops whose first ``start_quorum`` comes after many local steps (LocalSGD),
        where the warm-up is already done and a local first sync would only delay the heal.
        """
        self._machine.warmup_pending = False

    def wait_quorum(self) -> None:
        """Waits for the in-flight quorum; re-raises its error.

        Raises:
            TimeoutError, RuntimeError: the quorum RPC failed.
        """
        self._quorums.wait()

    def _apply_outcome(self, outcome: QuorumOutcome) -> None:
        """Quorum thread: takes in what the step's quorum work produced (the only writer)."""
        if outcome.reconfigured:
            self._connected.adopt(outcome.quorum.quorum_id, outcome.quorum.replica_ids)
        for error in outcome.errors:
            self.fail_step(error)
        self._heal.take_outcome(outcome)

    def _apply_pending_state_dict(self) -> None:
        """Training thread: loads the received user state (a failure undoes the heal)."""
        assert self._healing, "must be in healing state"
        self.wait_quorum()
        self._heal.apply()

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """The replica group's vote on this step; advances the step on success.

        Call after backward and before stepping the optimizer, on every rank of the group;
        step the optimizer only when it returns True.

        Args:
            timeout: the RPC timeout (the manager's ``timeout`` when None).

        Raises:
            RuntimeError: the RPC failed, or ``max_retries`` consecutive failures were exceeded.
            TimeoutError: the RPC timed out.
        """
        # Every collective of this step must have landed (or failed) before we vote.
        self._ledger.settle()
        if self._heal.end_warmup():
            return False  # the warm-up step is not voted on
        while True:
            pg_errored = self._settle_step()
            choice = self._machine.ballot(self._errored is not None)
            # A "no" that a redo would cure says so, and the group redoes the step only when
            # every rank's "no" does (a group of one rank: when its own does).
            salvageable = not choice.vote and self._salvage.salvageable(pg_errored)
            decision, redo = self._endpoints.vote(
                self._group_rank, choice.step, choice.vote, timeout or self._timeout, salvageable
            )
            if not redo or self._machine.salvaged:
                break
            self._salvage.redo(self._requorum, self.allreduce)
        return self._conclude(decision, choice.vote)

    def _settle_step(self) -> bool:
        """Before the vote: the heal's transfer, device work, errors, the heal's load, the
        divergence guard. Returns whether the process group reported an error (asked once)."""
        self._heal.settle()
        self._heal.synchronize()
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        pg_error = self._pg.errored()
        if pg_error is not None:
            self.fail_step(pg_error)
        if self._healing:
            self._apply_pending_state_dict()
        # The last comparison's verdict (a group that differs votes no); this step's, when due.
        self._guard.check(pg_errored=pg_error is not None)
        self._heal.check_torn()
        return pg_error is not None

    def _conclude(self, decision: bool, local: bool) -> bool:
        """After the group's decision: the log, telemetry, the counters, the retry limit."""
        num_participants = self.num_participants()
        # Every step: a commit at DEBUG (formatted only when enabled), a skipped step at INFO.
        self._logger.log(
            logging.DEBUG if decision else logging.INFO,
            "should_commit=%s (local vote %s: %d participants, min %d, errored=%s)",
            decision,
            local,
            num_participants,
            self._min_replica_size,
            self._errored is not None,
        )
        self._telemetry.committed(self._machine.step, self._quorum_id, decision)
        if not copies_state(self._checkpoint_transport):
            # The state changes after this: stop serving it (a transport that copies on write
            # copies what a healer still needs and lets it finish from the copy). One that
            # served its own copy lets a slow healer finish too (its next send replaces it).
            self._checkpoint_transport.disallow_checkpoint()
        fatal = self._machine.decided(decision)
        self._guard.raise_if_stopped()
        if fatal is not None:
            self._logger.warning(fatal)
            raise RuntimeError(fatal)
        return decision

    # -- manager state and queries --------------------------------------------------------

    def current_step(self) -> int:
        """Returns the number of committed steps (the first step is 0)."""
        return self._machine.step

    def batches_committed(self) -> int:
        """Returns the total batches committed over all steps and participating replicas."""
        return self._machine.batches_committed

    def participating_rank(self) -> int | None:
        """This replica's rank among the step's contributors, after the quorum in flight.

        None before the first ``start_quorum``, and for a replica that does not contribute.
        """
        settled = self._settled_participation()
        return None if settled is None else settled.rank

    def num_participants(self) -> int:
        """How many replicas contribute to this step, after the quorum in flight (0 before any)."""
        settled = self._settled_participation()
        return 0 if settled is None else settled.count

    def is_participating(self) -> bool:
        """Whether this replica's data counts this step (not a spare, not outside, not healing)."""
        return self._machine.contributes()

    def _settled_participation(self) -> Participation | None:
        # Nothing to wait for before the first start_quorum; afterwards the quorum in flight
        # decides (and its error, if any, is raised here).
        if self._quorums.future is None:
            return None
        self.wait_quorum()
        return self._machine.participation

    def shutdown(self, wait: bool = True) -> None:
        """Stops the checkpoint transport, the ManagerServer and the quorum thread.

        The process group is left alone (its owner shuts it down).

        Args:
            wait: wait for background work to finish.
        """
        self._checkpoint_transport.shutdown(wait=wait)
        self._endpoints.close()
        self._quorums.shutdown(wait=wait)
        self._worker.shutdown(wait=wait)
        self._telemetry.close()
