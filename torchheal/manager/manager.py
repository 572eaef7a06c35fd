"""The :class:`Manager`: the per-step fault-tolerance lifecycle on every rank (reference §6).

It composes parts that each do one job and are tested alone (see the package docstring), built
by :func:`~torchheal.manager.build.build_parts`. The Manager alone writes its step, quorum id
and participation; the rules it applies are pure functions in ``torchheal.coordination.plan``
(who participates) and ``torchheal.coordination.vote`` (the local vote, the retry limit).

Deliberate difference from the reference: the user's ``state_dict``/``load_state_dict`` run
only on the training thread. ``start_quorum`` captures ``_manager_state_dict()`` (tensor
references, cheap) before handing the quorum to the background thread, which only moves a
copy; the received state is loaded on the training thread
(:class:`~torchheal.manager.heal.HealStep`, which also holds why and when a healer's transfer
runs beside the step's collectives, and the warm-up of a group joining a running job).

Failing fast: when the lighthouse says a group of the current quorum is gone, every rank
aborts its cross-replica process group at once
(:class:`~torchheal.manager.failfast.ConnectedQuorum`), so a collective blocked on a dead group
fails now instead of at its timeout.

Salvaging (``salvage_step=True``, :mod:`torchheal.manager.salvage`): a step failed by such an
abort is redone in ``should_commit``, in a new quorum without the lost group, instead of being
skipped.

Errors: a quorum RPC error (timeout, lighthouse unreachable, not in the quorum) and a
``should_commit`` RPC error are raised; any other failure in a step (process-group
reconfiguration, checkpoint transfer, a collective) is reported and makes the step not commit.
"""

from __future__ import annotations

import logging
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import ReduceOp

from torchheal._base import config
from torchheal.checkpointing import CheckpointTransport, HTTPTransport
from torchheal.coordination.plan import Participation, WorldSizeMode
from torchheal.coordination.types import Notice, NoticeKind
from torchheal.coordination.vote import retry_limit_error
from torchheal.futures import Expiry, timed_then
from torchheal.manager.allreduce import IS_TRITON_AVAILABLE, averaging, start_allreduce
from torchheal.manager.build import build_parts, copies_state
from torchheal.manager.failfast import ConnectedQuorum
from torchheal.manager.heal import HealStep
from torchheal.manager.quorum_thread import QuorumThread
from torchheal.manager.quorum_worker import QuorumOutcome, StepRequest
from torchheal.manager.salvage import (
    LOSS_NOTICE_GRACE_S,
    NOT_A_LOSS,
    KeptAllreduce,
    KeptInputs,
    salvage_refusal,
)
from torchheal.manager.settings import ManagerSettings
from torchheal.manager.state import StateRegistry
from torchheal.manager.step import ExceptionWithTraceback, StepLedger
from torchheal.manager.views import View
from torchheal.process_group.work import _DummyWork, _ErrorRecordingWork
from torchheal.work import _ManagedWork

__all__ = ["IS_TRITON_AVAILABLE", "Manager"]

T = TypeVar("T")


def _value(f: torch.futures.Future[T]) -> T:
    return f.value()


class Manager:
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
        self._timeouts = settings.timeouts
        self._timeout: timedelta = settings.timeouts.timeout
        self._quorum_timeout: timedelta = settings.timeouts.quorum_timeout
        self._connect_timeout: timedelta = settings.timeouts.connect_timeout
        self._quorum_retries: int = settings.timeouts.quorum_retries
        self._group_rank: int = settings.group_rank
        self._group_world_size: int = settings.group_world_size

        self._state = StateRegistry(lock_timeout=self._timeout)
        self._replica_id = replica_id
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._replica_world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._commit_failures = 0
        self._salvage = config.salvage_step() if salvage_step is None else salvage_step
        self._kept = KeptInputs()
        self._salvaged = False  # this step was redone in a new quorum
        self._replaying = False

        if checkpoint_transport is None:
            checkpoint_transport = HTTPTransport(timeout=self._timeout, num_chunks=0)
        self._checkpoint_transport: CheckpointTransport[Any] = checkpoint_transport

        self._pg = pg

        self._step = 0
        parts = build_parts(
            settings,
            transport=self._checkpoint_transport,
            state=self._state,
            process_group=lambda: self._pg,
            current_step=self.current_step,
            replica_name=replica_id,
            hostname=hostname,
            heartbeat_interval=heartbeat_interval,
            use_async_quorum=use_async_quorum,
            init_sync=init_sync,
            world_size_mode=world_size_mode,
            min_replica_size=min_replica_size,
        )
        self._endpoints = parts.endpoints
        self._full_replica_id: str = self._endpoints.replica_id
        self._logger = parts.logger
        self._telemetry = parts.telemetry
        self._worker = parts.worker
        self._recovery = parts.recovery
        self._ledger = StepLedger()
        self._quorums = QuorumThread(self._worker, self._apply_outcome, self._telemetry)
        self._background_transfer = parts.background_transfer
        self._heal = HealStep(
            host=self,
            load_user=self._state.load,
            timeout=self._timeout,
            waited=self._telemetry.waited,
            log=self._logger,
            warmup=parts.warmup,
            healed=self._endpoints.healed,
        )

        self._connected = ConnectedQuorum(
            lambda: self._pg,
            self._logger,
            self._telemetry.process_group_aborted,
            gave_up=self._endpoints.gave_up,
        )
        self._batches_committed = 0
        # This step's contributors, as seen from this replica; None before the first quorum.
        self._participation: Participation | None = None
        self._worker.guard_builds(self._connected.building)
        self._endpoints.watch_lost(self._group_rank, self._on_notice)

    def _on_notice(self, notice: Notice) -> None:
        """What a lighthouse notice does (the one place): stop waiting on what it ends."""
        kind = notice.kind
        if kind is NoticeKind.DROPPED or kind is NoticeKind.SUPERSEDED:
            self._connected.on_dropped(
                notice.replica_id, notice.quorum_id, notice.reason, kind is NoticeKind.SUPERSEDED
            )
            return
        if kind is NoticeKind.LOST:
            # A heal from that group ends at once (a socket shutdown).
            self._recovery.on_member_lost(notice.replica_id, notice.quorum_id, notice.reason)
        # Lost, or a rank of ours gave that build up: ours for that quorum, built or not, will
        # never run with the others (they abandon theirs too).
        self._connected.on_member_lost(notice.replica_id, notice.quorum_id, notice.reason)

    # -- test-visible attributes of the reference (§2.2), kept as views of the parts ----------

    _errored = View("_ledger", "error")
    _healing = View("_heal", "healing")
    _pending_state_dict = View("_heal", "pending")
    _quorum_id = View("_connected", "quorum_id")
    _quorum_future = View("_quorums", "future")
    _state_dict_lock = View("_state", "lock", writable=False)
    _is_state_dict_read_allowed = View("_state", "reads_allowed", writable=False)

    @property
    def _participating_replica_rank(self) -> int | None:
        return None if self._participation is None else self._participation.rank

    @_participating_replica_rank.setter
    def _participating_replica_rank(self, rank: int | None) -> None:
        self._participation = Participation(rank, self._participating_replica_world_size)

    @property
    def _participating_replica_world_size(self) -> int:
        return 0 if self._participation is None else self._participation.count

    @_participating_replica_world_size.setter
    def _participating_replica_world_size(self, count: int) -> None:
        self._participation = Participation(self._participating_replica_rank, count)

    @property
    def salvage_step(self) -> bool:
        """Whether a step a replica group dies in is redone without it (``salvage_step``)."""
        return self._salvage

    # -- user state ----------------------------------------------------------------------

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers a named pair of user state functions sent to healing peers.

        Args:
            key: unique name; the receiver loads ``state["user"][key]`` with its function.
            load_state_dict: loads the received state (called on the training thread).
            state_dict: returns the state to send (called on the training thread).

        Raises:
            AssertionError: ``key`` is already registered.
        """
        self._state.register(key, load_state_dict, state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Deprecated: use :meth:`register_state_dict_fn`.

        Args:
            load_state_dict: see ``register_state_dict_fn``.
            state_dict: see ``register_state_dict_fn``.
        """
        warnings.warn(
            "Manager.set_state_dict_fns is deprecated; use register_state_dict_fn",
            DeprecationWarning,
            stacklevel=2,
        )
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """Lets peers read the state dict again after :meth:`disallow_state_dict_read`."""
        self._state.unblock_reads()

    def disallow_state_dict_read(self) -> None:
        """Makes state-dict reads wait while the state is being changed (idempotent)."""
        self._state.block_reads()
        if getattr(self._checkpoint_transport, "copies_on_write", False) is True:
            # A transport serving the state where it lies copies what a healer still needs now.
            self._checkpoint_transport.disallow_checkpoint()

    def _manager_state_dict(self) -> dict[str, Any]:
        return self._state.read(self.state_dict)

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
        self._kept.begin()
        self._salvaged = False
        if self._heal.begin():
            self._start_warmup()
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
        # Captured on this (the training) thread. A torn replica (a heal into its own tensors
        # failed part way, at step 0) sends it only as the source at step 0 (HealStep).
        captured = self._capture_state_dict() if allow_heal else None
        return StepRequest(
            step=self._step,
            commit_failures=self._commit_failures,
            current_quorum_id=self._quorum_id,
            allow_heal=allow_heal,
            shrink_only=shrink_only,
            timeout=timeout or self._quorum_timeout,
            captured=captured,
            device=torch.cuda.current_device() if torch.cuda.is_available() else -1,
            can_load=not self._state.empty,
            background=self._background_transfer,
            # Nothing worth keeping (never committed): a heal receives into its own tensors.
            heal_in_place=self._step == 0 and self._batches_committed == 0,
        )

    def _start_warmup(self) -> None:
        """This group (re)started into a running job: its first step runs alone (see
        :mod:`torchheal.manager.heal`). It joins no quorum and counts no participant."""
        self._quorums.skip()
        self._participation = Participation(rank=None, count=0)

    def skip_warmup(self) -> None:
        """Joins the quorum at the first step even when the job is already running.

        For training loops whose first ``start_quorum`` comes after many local steps (LocalSGD),
        where the warm-up is already done and a local first sync would only delay the heal.
        """
        self._heal.skip_warmup()

    def wait_quorum(self) -> None:
        """Waits for the in-flight quorum; re-raises its error.

        Raises:
            TimeoutError, RuntimeError: the quorum RPC failed.
        """
        self._quorums.wait()

    def _capture_state_dict(self) -> dict[str, Any] | None:
        if self._state.empty:
            return None
        if not self._state.reads_allowed:
            # This thread holds the writer side; reading would wait for ourselves.
            self._logger.warning(
                "state-dict reads are disallowed at start_quorum; cannot serve recovery this step"
            )
            return None
        try:
            return self._manager_state_dict()
        except Exception as e:
            self._logger.exception(f"capturing the state dict failed: {e}")
            self.report_error(e)
            return None

    def _apply_outcome(self, outcome: QuorumOutcome) -> None:
        """Quorum thread: takes in what the step's quorum work produced (the only writer)."""
        self._participation = outcome.participation
        if outcome.reconfigured:
            self._connected.adopt(outcome.quorum.quorum_id, outcome.quorum.replica_ids)
        for error in outcome.errors:
            self._fail_step(error)
        self._heal.take_outcome(outcome)

    def _apply_pending_state_dict(self) -> None:
        """Training thread: loads the received user state (a failure undoes the heal)."""
        assert self._healing, "must be in healing state"
        self.wait_quorum()
        self._heal.apply()

    # -- collectives --------------------------------------------------------------------

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp = ReduceOp.AVG,
    ) -> torch.distributed.Work:
        """Fault-tolerant allreduce across the participating replicas, in place.

        AVG is a SUM divided by the number of participating replicas. Errors are not raised:
        they are reported, the returned work completes with the (garbage) tensor, and every
        later allreduce of the step is a no-op.

        Args:
            tensor: the tensor to reduce in place.
            should_quantize: send 8-bit quantized data (SUM/AVG only).
            reduce_op: the reduction; AVG needs a floating point tensor.

        Raises:
            ValueError: AVG on a non-floating point tensor.
            TimeoutError, RuntimeError: the quorum of this step failed.
        """
        if self._heal.warming_up:
            return _DummyWork(tensor)  # the warm-up step's collectives are local no-ops
        if self._salvage and not self._replaying:
            self._kept.keep(tensor, reduce_op, should_quantize)  # before it is reduced
        if self.errored():
            return _DummyWork(tensor)
        self.wait_quorum()
        num_participants = self.num_participants()
        is_avg = reduce_op == ReduceOp.AVG
        if is_avg and not tensor.is_floating_point():
            # Worded as the reference's; its tests match this text.
            raise ValueError("average reduce op is only supported for floating point tensors")
        if not self.is_participating():
            # Healing replicas and spares contribute zeros but stay in lock-step.
            tensor.zero_()
        # Before it starts: an abort of the group for its quorum (a lost peer, or this group's
        # own drop) ends what is pending in it, this collective included.
        expiry = self._connected.expiry
        try:
            work = start_allreduce(self._pg, tensor, reduce_op, should_quantize)
        except Exception as e:
            lost = self._connected.aborted_for
            self._telemetry.allreduce_failed()
            if lost is not None:  # the fail-fast abort of a lost peer: expected, no traceback
                how = f"allreduce not started: the process group was aborted as {lost}"
                self._fail_step(e, how=how, cause=False)
            else:
                self._fail_step(e, how="allreduce failed to start", trace=True)
            return _DummyWork(tensor)

        # Counts this allreduce's failure once, whether wait() or its future reports it.
        work = _ErrorRecordingWork(work, self._telemetry.allreduce_error_counter())
        managed = _ManagedWork(self, work, tensor, expiry)
        managed.get_future().then(averaging(tensor, num_participants if is_avg else 1))
        self._ledger.track_work(managed)
        return managed

    def report_error(self, e: Exception) -> None:
        """Marks this step as failed: it will not commit, and the PG is rebuilt next step.

        Args:
            e: what failed.
        """
        self._fail_step(e, foreign=True)

    def _fail_step(
        self,
        e: Exception,
        foreign: bool = False,
        how: str = "step failed",
        trace: bool = False,
        cause: bool = True,
    ) -> None:
        # ``foreign``: reported by the training loop, not by the step's collectives or quorum
        # (a new quorum would not cure it: such a step is never salvaged). One failure fails
        # every collective of the step after it (a lost peer: each bucket's allreduce), so only
        # the step's first error is logged where users look; the rest go to debug. ``cause``
        # False: ``how`` says it all (the error itself only repeats it in the backend's words).
        first = self._ledger.report(e, foreign=foreign)
        self._telemetry.error()
        if first:
            line = f"{how}: {type(e).__name__}: {e}" if cause else how
            self._logger.warning(line, exc_info=e if trace else None)
        else:
            self._logger.debug(f"{how} (the step had failed already): {type(e).__name__}: {e}")

    def errored(self) -> ExceptionWithTraceback | None:
        """Returns the error reported in this step, or None."""
        return self._ledger.error

    def wrap_future(
        self,
        fut: torch.futures.Future[T],
        default: T,
        timeout: timedelta | None = None,
    ) -> torch.futures.Future[T]:
        """Adds a timeout to ``fut`` and swallows its error into ``report_error``.

        Args:
            fut: the future to wrap.
            default: the value the returned future holds when ``fut`` fails or times out.
            timeout: defaults to the manager's ``timeout``.
        """

        # The loop's own future: a salvage would not redo it, so its failure stands.
        return self._wrap_future_then(fut, _value, default, timeout, foreign=True)

    def _wrap_future_then(
        self,
        fut: torch.futures.Future[Any],
        then: Callable[[torch.futures.Future[Any]], T],
        default: T,
        timeout: timedelta | None = None,
        foreign: bool = False,
        expiry: Expiry | None = None,
    ) -> torch.futures.Future[T]:
        # ``wrap_future(fut.then(then), default)`` in one callback on ``fut``: this runs for
        # every gradient bucket, on the thread completing its collective (torchheal.work).
        def callback(f: torch.futures.Future[Any]) -> T:
            try:
                return then(f)
            except Exception as e:
                # The loop's own futures may fail for a bug: their first failure keeps its trace.
                self._fail_step(e, foreign, "future failed, skipping the step", trace=foreign)
                return default

        wrapped = timed_then(fut, timeout or self._timeout, callback, expiry)
        self._ledger.track_future(wrapped)
        return wrapped

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
            self._settle_step()
            choice = self._heal.ballot(
                self._step,
                self.num_participants(),
                self._min_replica_size,
                self._errored is not None,
            )
            # A "no" that a redo would cure says so, and the group redoes the step only when
            # every rank's "no" does (a group of one rank: when its own does).
            salvageable = not choice.vote and self._salvageable()
            decision, redo = self._endpoints.vote(
                self._group_rank, choice.step, choice.vote, timeout or self._timeout, salvageable
            )
            if not redo or self._salvaged:
                break
            self._redo_step(self._kept.take())
        return self._conclude(decision, choice.vote)

    def _settle_step(self) -> None:
        """Before the vote: the heal's transfer, device work, errors, the heal's load."""
        self._heal.settle()
        self._heal.synchronize()
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        pg_error = self._pg.errored()
        if pg_error is not None:
            self._fail_step(pg_error)
        if self._healing:
            self._apply_pending_state_dict()
        self._heal.check_torn()

    def _conclude(self, decision: bool, local: bool) -> bool:
        """After the group's decision: the log, telemetry, the counters, the retry limit."""
        num_participants = self.num_participants()
        # Every step, so a commit logs at DEBUG (formatted only when enabled); a skipped step at
        # INFO.
        self._logger.log(
            logging.DEBUG if decision else logging.INFO,
            "should_commit=%s (local vote %s: %d participants, min %d, errored=%s)",
            decision,
            local,
            num_participants,
            self._min_replica_size,
            self._errored is not None,
        )
        self._telemetry.committed(self._step, self._quorum_id, decision)
        if not copies_state(self._checkpoint_transport):
            # The state changes after this: stop serving it (a transport that copies on write
            # copies what a healer still needs and lets it finish from the copy). One that
            # served its own copy lets a slow healer finish too (its next send replaces it).
            self._checkpoint_transport.disallow_checkpoint()
        if decision:
            self._step += 1
            self._batches_committed += num_participants
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            message = retry_limit_error(self._commit_failures, self._max_retries)
            if message is not None:
                self._logger.warning(message)
                raise RuntimeError(message)
        return decision

    def _salvageable(self) -> bool:
        """Whether a redo in a new quorum would cure this step (``salvage_refusal``).

        See :mod:`torchheal.manager.salvage`. On the training thread, in ``should_commit``,
        once every collective of the step has ended.
        """
        if not self._salvage:
            return False  # the default: nothing kept, nothing asked
        facts = dict(
            enabled=self._salvage,
            errored=self._errored is not None or self._pg.errored() is not None,
            foreign=self._ledger.foreign_error,
            kept=len(self._kept.records),
            healing=self._healing,
            contributed=self.is_participating(),
            already_salvaged=self._salvaged,
        )
        refusal = salvage_refusal(
            aborted_for=self._connected.aborted_for, dropped=self._connected.dropped, **facts
        )
        if refusal == NOT_A_LOSS:
            # A collective fails on the dead group's connections before the notice arrives.
            lost = self._connected.wait_aborted(LOSS_NOTICE_GRACE_S)
            refusal = salvage_refusal(aborted_for=lost, dropped=self._connected.dropped, **facts)
        if refusal is not None and self._errored is not None:
            self._logger.info(f"step {self._step} not salvaged: {refusal}")
        return refusal is None

    def _redo_step(self, kept: list[KeptAllreduce]) -> None:
        """Redoes the step's allreduces from their kept inputs, in a new quorum of the step."""
        if not self._salvage:
            # Another rank of the group salvages and this one kept nothing to redo from: its
            # gradients would disagree with theirs. The step fails instead.
            self._fail_step(RuntimeError("the group's ranks disagree on salvage_step"))
            return
        why = self._connected.aborted_for or "another rank of the group lost a replica group"
        self._logger.warning(
            f"salvaging step {self._step}: {why}; redoing its {len(kept)} allreduces in a new "
            "quorum"
        )
        self._salvaged = True
        self._ledger.drain()  # nothing of the failed attempt may still write into the tensors
        self._heal.drain()  # a transfer of the failed attempt's quorum: dropped
        self._ledger.begin()
        self._quorums.submit(self._step_request(True, True, None))
        try:
            self.wait_quorum()
        except Exception as e:
            self._fail_step(e)
            return
        self._replaying = True
        try:
            for k in kept:
                k.tensor.copy_(k.kept)
                self.allreduce(k.tensor, k.should_quantize, k.reduce_op)
        finally:
            self._replaying = False
        self._ledger.settle()
        if self._errored is None:
            self._telemetry.salvaged()

    # -- manager state and queries --------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores the step and batch counters (from a checkpoint or a healing peer).

        Args:
            state_dict: ``{"step": int, "batches_committed": int}``.
        """
        self._step = state_dict["step"]
        self._batches_committed = state_dict["batches_committed"]

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"step", "batches_committed"}``; checkpoint it with the user state."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def current_step(self) -> int:
        """Returns the number of committed steps (the first step is 0)."""
        return self._step

    def batches_committed(self) -> int:
        """Returns the total batches committed over all steps and participating replicas."""
        return self._batches_committed

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
        current = self._participation
        return current is not None and current.contributes(healing=self._healing)

    def _settled_participation(self) -> Participation | None:
        # Nothing to wait for before the first start_quorum; afterwards the quorum in flight
        # decides (and its error, if any, is raised here).
        if self._quorums.future is None:
            return None
        self.wait_quorum()
        return self._participation

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
