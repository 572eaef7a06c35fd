"""What the quorum thread does for one step, returned as data for the Manager to apply.

:meth:`QuorumWorker.run` joins the group's quorum round, works out this replica's part
(:func:`~torchheal.coordination.plan.participation`), rebuilds the process group when the quorum
changed, and moves state through :class:`~torchheal.manager.recovery.Recovery`. It writes
nothing of the Manager's: it returns a :class:`QuorumOutcome`, which the Manager alone applies.
A quorum RPC error is raised; every other failure is collected in the outcome.

With ``background`` the transfer runs beside the step's collectives on a transfer thread (the
outcome carries its future, awaited in ``should_commit``); a healer contributes zeros either way,
so its peers need not wait for its transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from torchheal.checkpointing.timeline import mark
from torchheal.coordination.plan import Participation, WorldSizeMode, participation
from torchheal.coordination.types import QuorumAsk, QuorumResult
from torchheal.manager.log import ManagerLogger, describe_quorum
from torchheal.manager.recovery import Recovery
from torchheal.process_group.base import accepts_quorum_keywords
from torchheal.process_group.store import parse_store_addr
from torchheal.utils import quorum_global_ranks

__all__ = ["QuorumOutcome", "QuorumWorker", "StepRequest", "Transfer"]


#: ``guard(quorum_id, replica_ids, store_port)``: the context a process-group build runs in.
_BuildGuard = Callable[[int, Sequence[str], int], AbstractContextManager[Any]]


@dataclass
class Transfer:
    """What one step's state transfer produced.

    Args:
        received: the state that arrived (``{"user", "torchft"}``), or None.
        errors: what failed; any of them makes the step not commit.
        recovery_event: a CUDA event after the transfer (None without CUDA).
    """

    received: dict[str, Any] | None = None
    errors: list[Exception] = field(default_factory=list)
    recovery_event: Any = None


@dataclass
class QuorumOutcome:
    """What one step's quorum work produced.

    Args:
        quorum: this rank's quorum result.
        participation: this replica's part in the step's reductions.
        reconfigured: the process group was rebuilt for ``quorum.quorum_id``.
        healing: this replica is behind and was to receive its state this step.
        received: the state that arrived (``{"user", "torchft"}``), or None.
        errors: what failed, in order; any of them makes the step not commit.
        recovery_event: a CUDA event after the transfer (None without CUDA).
        transfer: the transfer running beside the step's collectives (a background request
            that moves state), whose result replaces ``received`` and adds to ``errors``.
    """

    quorum: QuorumResult
    participation: Participation
    reconfigured: bool = False
    healing: bool = False
    received: dict[str, Any] | None = None
    errors: list[Exception] = field(default_factory=list)
    recovery_event: Any = None
    transfer: Future[Transfer] | None = None


@dataclass(frozen=True)
class StepRequest:
    """One step's arguments to the quorum thread, captured on the training thread.

    Args:
        step: the step this replica is at.
        commit_failures: consecutive failed commits so far.
        current_quorum_id: the quorum the process group is configured for (-1: none).
        allow_heal: send/receive state this step.
        shrink_only: ask the lighthouse not to admit new replicas.
        timeout: the quorum's deadline.
        captured: the state a healing peer would receive (references to live tensors).
        device: the training thread's CUDA device (-1 without CUDA).
        can_load: a ``load_state_dict`` function is registered, so this replica can heal
            (torchtitan registers them only after building the Manager).
        background: move state beside the step's collectives (``QuorumOutcome.transfer``)
            instead of before them.
        heal_in_place: a heal receives straight into ``captured`` (this replica's own
            tensors) where the transport can: its state holds nothing worth keeping if the
            receive fails part way.
    """

    step: int
    commit_failures: int
    current_quorum_id: int
    allow_heal: bool
    shrink_only: bool
    timeout: timedelta
    captured: dict[str, Any] | None
    device: int = -1
    can_load: bool = True
    background: bool = False
    heal_in_place: bool = False


class QuorumWorker:
    """Runs a step's quorum, reconfiguration and transfer on the quorum thread.

    Args:
        quorum_call: this rank's quorum RPC (``GroupEndpoints.quorum``).
        process_group: returns the cross-replica process group (``configure`` is called on a
            new quorum); read each time, so whoever swaps the Manager's ``_pg`` is followed.
        recovery: sends and receives state.
        snapshot: makes a private copy of captured state before it is sent (the identity
            when the transport copies it itself).
        send_guard: held around the snapshot and the send (the state's read lock when the
            transport copies the state itself).
        metadata: returns this replica's checkpoint transport metadata.
        group_rank: this rank's index in its replica group.
        replica_name: the user's replica id (passed to ``pg.configure``; ``"0"`` when None).
        use_async_quorum: whether the quorum runs during the forward pass.
        init_sync: heal replicas at step 0 so all start identical.
        world_size_mode: DYNAMIC or FIXED_WITH_SPARES.
        min_replica_size: the Manager's ``min_replica_size``.
        log: the Manager's prefixed logger.
        group_world_size: the number of ranks in this replica group (names the rebuilt
            process group after the quorum).
        quorum_start: this rank's quorum RPC without waiting (``GroupEndpoints.start_quorum``):
            a future of its result, or None where only the blocking call exists.
        record_quorum: called with a new quorum's id before its process group is built
            (``GroupEndpoints.record_quorum``: the group's store remembers it across restarts).
        member_data: returns the ``data`` this rank's quorum requests carry (group rank 0:
            its divergence guard's report, which the lighthouse's dashboard shows).
    """

    def __init__(
        self,
        *,
        quorum_call: Callable[[QuorumAsk], QuorumResult],
        process_group: Callable[[], Any],
        recovery: Recovery,
        snapshot: Callable[[dict[str, Any]], dict[str, Any]],
        metadata: Callable[[], str],
        group_rank: int,
        replica_name: str | None,
        use_async_quorum: bool,
        init_sync: bool,
        world_size_mode: WorldSizeMode,
        min_replica_size: int,
        log: ManagerLogger,
        group_world_size: int = 1,
        send_guard: Callable[[], AbstractContextManager[Any]] = nullcontext,
        quorum_start: Callable[[QuorumAsk], Future[QuorumResult] | None] | None = None,
        record_quorum: Callable[[int], None] = lambda quorum_id: None,
        member_data: Callable[[], dict[str, Any] | None] = lambda: None,
    ) -> None:
        self._member_data = member_data
        self._quorum_call = quorum_call
        self._record_quorum = record_quorum
        self._quorum_start = quorum_start
        self._send_guard = send_guard
        # Background transfers and the metadata fetch that overlaps the group's rebuild.
        self._transfers = ThreadPoolExecutor(2, thread_name_prefix="torchheal-transfer")
        self._process_group = process_group
        self._recovery = recovery
        self._snapshot = snapshot
        self._metadata = metadata
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._replica_name = replica_name or "0"
        self._use_async_quorum = use_async_quorum
        self._init_sync = init_sync
        self._world_size_mode = world_size_mode
        self._min_replica_size = min_replica_size
        self._log = log
        self._recovery_stream: Any = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._build_guard: _BuildGuard = lambda quorum_id, replica_ids, store_port: nullcontext()

    def run(self, request: StepRequest) -> QuorumOutcome:
        """Joins the quorum, rebuilds the group if it changed, and moves state.

        Args:
            request: the step's arguments.

        Raises:
            TimeoutError, RuntimeError: the quorum RPC failed.
        """
        mark("quorum.begin", step=request.step)
        quorum = self._quorum_call(self._ask(request))
        return self.finish(request, quorum)

    def start(self, request: StepRequest) -> Future[QuorumResult] | None:
        """Sends this step's quorum request without waiting for the answer.

        Args:
            request: the step's arguments.

        Returns:
            the future answer (its callbacks may run on the manager server's loop thread),
            or None where the quorum can only be asked for by :meth:`run`.
        """
        if self._quorum_start is None:
            return None
        mark("quorum.begin", step=request.step)
        return self._quorum_start(self._ask(request))

    def blocks(self, request: StepRequest, quorum: QuorumResult) -> bool:
        """Whether :meth:`finish` has work that may wait: rebuild the group, move state.

        Otherwise (the quorum of the last step again, nobody to heal) it only works out the
        participation, quickly, on whichever thread has the answer.

        Args:
            request: the step's arguments.
            quorum: the answer.
        """
        return quorum.quorum_id != request.current_quorum_id or self._moves(request, quorum)

    def _ask(self, request: StepRequest) -> QuorumAsk:
        return QuorumAsk(
            group_rank=self._group_rank,
            step=request.step,
            checkpoint_metadata=self._metadata(),
            shrink_only=request.shrink_only,
            init_sync=self._init_sync,
            commit_failures=request.commit_failures,
            timeout=request.timeout,
            data=self._member_data(),
        )

    @staticmethod
    def _moves(request: StepRequest, quorum: QuorumResult) -> bool:
        return request.allow_heal and (quorum.heal or bool(quorum.recover_dst_replica_ranks))

    def finish(self, request: StepRequest, quorum: QuorumResult) -> QuorumOutcome:
        """The step's work after the answer: participation, rebuild, state moves.

        Args:
            request: the step's arguments.
            quorum: the answer to its quorum request.
        """
        if request.device >= 0 and torch.cuda.is_available() and self.blocks(request, quorum):
            torch.cuda.set_device(request.device)  # the quorum thread's CUDA work
        mark(
            "quorum.end",
            quorum_id=quorum.quorum_id,
            heal=quorum.heal,
            replicas=len(quorum.replica_ids),
            current=request.current_quorum_id,
        )
        outcome = QuorumOutcome(
            quorum=quorum,
            participation=participation(
                quorum,
                self._use_async_quorum,
                request.allow_heal,
                self._world_size_mode,
                self._min_replica_size,
            ),
        )
        moves = self._moves(request, quorum)
        metadata: Future[str] | None = None
        if moves and request.background:
            # The transport does not use the process group: the transfer starts now, while
            # the group is being rebuilt, and runs on beside the step's collectives.
            outcome.healing = quorum.heal
            outcome.transfer = self._transfers.submit(self._transfer, quorum, request, None)
        elif moves and quorum.heal and request.can_load:
            # Ask the source how to reach its state while the group is being rebuilt.
            metadata = self._transfers.submit(self._recovery.fetch_metadata, quorum)
        if quorum.quorum_id != request.current_quorum_id:
            try:
                self._reconfigure(outcome)
            except Exception as e:
                # No transfer in the quorum this step (one already running beside it fails
                # the step all the same); the quorum id stays, so the next step tries again.
                self._log.exception(f"applying quorum {quorum.quorum_id} failed: {e}")
                outcome.errors.append(e)
                return outcome
        if moves and not request.background:
            outcome.healing = quorum.heal
            transfer = self._transfer(quorum, request, metadata)
            outcome.received = transfer.received
            outcome.errors.extend(transfer.errors)
            outcome.recovery_event = transfer.recovery_event
        elif request.allow_heal:
            outcome.healing = quorum.heal
        return outcome

    def guard_builds(self, guard: _BuildGuard) -> None:
        """Runs every process-group build inside ``guard(quorum_id, replica_ids, store_port)``.

        Args:
            guard: a context manager factory that may abandon the build (the Manager's
                :meth:`ConnectedQuorum.building <torchheal.manager.failfast.ConnectedQuorum.building>`).
        """
        self._build_guard = guard

    def shutdown(self, wait: bool = True) -> None:
        """Stops the transfer threads.

        Args:
            wait: wait for a transfer in progress.
        """
        self._transfers.shutdown(wait=wait)

    def _reconfigure(self, outcome: QuorumOutcome) -> None:
        quorum = outcome.quorum
        self._log.info(describe_quorum(quorum, outcome.participation))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        mark("configure.begin", quorum_id=quorum.quorum_id)
        self._record_quorum(quorum.quorum_id)
        pg = self._process_group()
        quorum_keywords: dict[str, Any] = {}
        if accepts_quorum_keywords(pg):
            # Newer reference versions pass these; older four-argument groups still work.
            quorum_keywords = dict(
                quorum_id=quorum.quorum_id,
                group_rank=self._group_rank,
                group_world_size=self._group_world_size,
                global_ranks=quorum_global_ranks(
                    list(quorum.replica_ids), self._group_rank, self._group_world_size
                ),
            )
        store_addr = f"{quorum.store_address}/torchft/{quorum.quorum_id}/{self._group_rank}"
        with self._build_guard(
            quorum.quorum_id, quorum.replica_ids, parse_store_addr(store_addr)[1]
        ):
            pg.configure(
                store_addr,
                self._replica_name,
                quorum.replica_rank,
                quorum.replica_world_size,
                **quorum_keywords,
            )
        outcome.reconfigured = True
        mark("configure.end", quorum_id=quorum.quorum_id)

    def _transfer(
        self, quorum: QuorumResult, request: StepRequest, metadata: Future[str] | None
    ) -> Transfer:
        captured = request.captured
        outcome = Transfer()
        stream = self._recovery_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            try:
                if quorum.recover_dst_replica_ranks:
                    if captured is None:
                        raise RuntimeError(
                            "peers need recovery but no state was captured at start_quorum "
                            "(no state_dict function registered, or reads were disallowed)"
                        )
                    with self._send_guard():
                        mark("snapshot.begin")
                        snapshot = self._snapshot(captured)
                        mark("snapshot.end")
                        self._recovery.send(quorum, snapshot)
                    mark("send.end")
                if quorum.heal:
                    if not request.can_load:
                        # Fail the step now rather than fetch state nobody can load.
                        raise RuntimeError(
                            "this replica must heal from replica rank "
                            f"{quorum.recover_src_replica_rank} but has no load_state_dict "
                            "function: pass Manager(load_state_dict=..., state_dict=...) or "
                            "call register_state_dict_fn() before the first step"
                        )
                    mark("receive.begin")
                    address = metadata.result() if metadata is not None else None
                    into = captured if request.heal_in_place else None
                    outcome.received = self._recovery.receive(quorum, address, into)
                    mark("receive.end")
            except Exception as e:
                self._log.exception(f"recovery failed: {e}")
                outcome.errors.append(e)
            if stream is not None:
                outcome.recovery_event = stream.record_event()
        return outcome
