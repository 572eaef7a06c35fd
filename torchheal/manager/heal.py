"""A replica's heal, on the training thread's side: what arrived, when to load it, the warm-up.

The quorum thread works out who heals and moves the state
(:class:`~torchheal.manager.quorum_worker.QuorumWorker`); :class:`HealStep` keeps the result
until the training thread can use it. The user's ``load_state_dict`` runs only on the training
thread (a deliberate difference from the reference, whose quorum thread loads during the forward
pass and breaks FSDP2/DTensor models): with a synchronous quorum it is loaded in
``start_quorum``, with an asynchronous one in ``should_commit``.

Healing beside the step's collectives (with a torchheal lighthouse and a transport that does
not use the process group, HTTP by default): a healer contributes zeros to its heal step's
reductions, so its transfer runs on a transfer thread while the collectives go on, and
``should_commit`` waits for it (:meth:`HealStep.settle`) before loading. A transfer that
outlives the manager's timeout fails the step; what it delivers later is dropped.

Receiving in place: a replica at step 0 that has never committed (a restarted group) holds
nothing worth keeping, so its heal receives straight into its own tensors (no fresh memory, no
copy when loading; ``StepRequest.heal_in_place``). If that receive fails part way, its tensors
hold a mix of old and unverified bytes: the replica is *torn* (:attr:`HealStep.torn`) until a
later heal succeeds. A torn replica never commits a step it did not heal in, except when the
plan makes it the source at step 0 (its source died mid-transfer, so every survivor is torn):
its state becomes the job's initial state.

The warm-up: a group that (re)starts into a running job takes its first step alone. A restarted
process's first iteration is its slowest (allocations, autograd and DDP warm-up); taken inside a
quorum, every other group would wait for it in the step's collectives. So that step joins no
quorum: its collectives are local no-ops, it counts no participant, and ``should_commit``
returns False without voting (nothing is applied, the step counter stays). The next step joins
the quorum and heals at full speed. It is decided once, from the lighthouse's welcome (a
torchheal lighthouse that had issued a quorum before this group said hello), so it is the same
on every rank of the group.

:class:`HealStep` knows nothing of servers or process groups; it is tested with plain futures
and a small host (``tests/manager/test_heal_unit.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Protocol

from torchheal.checkpointing.timeline import mark
from torchheal.checkpointing.transport import TornCheckpointError
from torchheal.coordination.vote import Ballot, ballot
from torchheal.manager.log import ManagerLogger
from torchheal.manager.quorum_worker import QuorumOutcome, Transfer

__all__ = ["HealHost", "HealStep"]


class HealHost(Protocol):
    """What a heal needs of its Manager: its counters and its step's error (public methods)."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state_dict: dict[str, int]) -> None: ...

    def report_error(self, e: Exception) -> None: ...

    def errored(self) -> object: ...


class HealStep:
    """One step's heal as the training thread sees it, and the warm-up before the first one.

    Attributes written from the quorum thread (:meth:`take_outcome`) are read by the training
    thread only after it has waited for that quorum, as the Manager's own fields always were.

    Args:
        host: the Manager (its counters are restored from the received state; failures are
            reported to it).
        load_user: loads the received user state (``StateRegistry.load``).
        timeout: how long ``should_commit`` waits for a transfer that runs beside the step.
        waited: told how long the training thread waited for a transfer (seconds).
        log: the Manager's prefixed logger.
        warmup: this group (re)started into a running job: its first step runs alone.
    """

    def __init__(
        self,
        *,
        host: HealHost,
        load_user: Callable[[Any], None],
        timeout: timedelta,
        waited: Callable[[float], None],
        log: ManagerLogger,
        warmup: bool = False,
        healed: Callable[[], None] = lambda: None,
    ) -> None:
        self._host = host
        self._healed = healed
        self._load_user = load_user
        self._timeout = timeout
        self._waited = waited
        self._log = log
        #: This replica is behind and receives its state this step.
        self.healing = False
        #: The received state (``{"user", "torchft"}``) waiting for the training thread.
        self.pending: dict[str, Any] | None = None
        #: The Manager's counters before a heal overwrote them; restored if loading fails.
        self.pre_heal: dict[str, int] | None = None
        #: A CUDA event after the last transfer (None without CUDA).
        self.recovery_event: Any = None
        #: The transfer running beside the step's collectives, with the quorum's max step.
        self.transfer: tuple[Future[Transfer], int] | None = None
        #: The next step is the warm-up (cleared by :meth:`skip_warmup` or when it starts).
        self.warmup_pending = warmup
        #: This step is the warm-up.
        self.warming_up = False
        #: A receive into this replica's own tensors failed part way: they hold a mix of old
        #: and unverified bytes until a heal succeeds.
        self.torn = False
        #: The step of a heal this replica was part of and its counters have not reached yet
        #: (its receive or load failed): its votes are not below it (see :meth:`vote_step`).
        self.heal_target = 0

    def drain(self) -> None:
        """Training thread, step start: the last step's transfer (its should_commit never
        came) ends before this step's begins; its result is dropped."""
        pending, self.transfer = self.transfer, None
        if pending is not None:
            try:
                pending[0].result(timeout=self._timeout.total_seconds())
            except Exception as e:
                self._log.warning(f"an unfinished state transfer was dropped: {e!r}")

    def begin(self) -> bool:
        """Training thread, step start: forgets the last step's heal.

        Returns:
            True when this step is the warm-up (it joins no quorum).
        """
        self.healing = False
        self.pending = None
        self.pre_heal = None
        self.warming_up = False
        if not self.warmup_pending:
            return False
        self.warmup_pending = False
        self.warming_up = True
        mark("warmup.begin")
        self._log.info("joining a running job: warming up with one local step first")
        return True

    def skip_warmup(self) -> None:
        """The first step joins the quorum even when the job is already running."""
        self.warmup_pending = False

    def end_warmup(self) -> bool:
        """Training thread, ``should_commit``: ends the warm-up step.

        Returns:
            True when this step was the warm-up (it is not voted on).
        """
        if not self.warming_up:
            return False
        self.warming_up = False
        mark("warmup.end")
        self._log.info("warm-up step done (not committed); the next step joins the quorum")
        return True

    def take_outcome(self, outcome: QuorumOutcome) -> None:
        """Quorum thread: keeps the heal part of the step's quorum work."""
        self._note_torn(outcome.errors)
        if self.torn and not outcome.healing and outcome.quorum.max_step == 0:
            # Torn replicas are replicas at step 0 whose source died while they received its
            # initial state, so usually every survivor is torn. The plan made this one the
            # source: nothing trained yet, its state is as good an initial state as any, and
            # the others sync to it. Refusing would bring the same plan back every round, and
            # no step would ever commit (issue 40, bug 2).
            self.torn = False
            self._log.warning(
                "this replica's initial state was partly overwritten by a heal that failed, "
                "and it is now the quorum's source at step 0: its state becomes the initial "
                "state the others sync to"
            )
        if outcome.recovery_event is not None:
            self.recovery_event = outcome.recovery_event
        if outcome.transfer is not None:
            # Runs beside the step's collectives; should_commit waits for it.
            self.transfer = (outcome.transfer, outcome.quorum.max_step)
        if not outcome.healing:
            return
        self.healing = True
        self.heal_target = max(self.heal_target, outcome.quorum.max_step)
        if outcome.received is not None:
            # The manager's own counters are restored now, as the reference does; the user
            # state waits for the training thread.
            self.take(outcome.received, outcome.quorum.max_step)

    def take(self, received: dict[str, Any], max_step: int) -> None:
        """Keeps what arrived for the training thread and restores the manager's counters.

        Args:
            received: the state that arrived (``{"user", "torchft"}``).
            max_step: the quorum's step, which the healer joins.
        """
        self.pre_heal = self._host.state_dict()
        self.pending = received
        self._host.load_state_dict(received["torchft"])
        # The quorum's step, whatever step the sender's counters were captured at.
        self._host.load_state_dict({**self._host.state_dict(), "step": max_step})

    def ballot(
        self, step: int, num_participants: int, min_replica_size: int, errored: bool
    ) -> Ballot:
        """This rank's vote on its step (``vote.ballot``), at ``step`` by its counters: after a
        heal that failed here, on the step its group healed to. Keeps what the vote leaves of
        the heal's target."""
        choice = ballot(
            step=step,
            heal_target=self.heal_target,
            num_participants=num_participants,
            min_replica_size=min_replica_size,
            errored=errored,
        )
        self.heal_target = choice.heal_target
        return choice

    def vote_step(self, step: int) -> int:
        """The step this replica votes on, at ``step`` by its counters (see :meth:`ballot`)."""
        return self.ballot(step, 0, 0, False).step

    def settle(self) -> None:
        """Training thread: waits for the transfer that ran beside the step's collectives.

        Its failures fail the step; what arrived is kept for loading (a healer). Bounded by
        the manager's timeout; a transfer still running then fails the step, and what it
        receives later is dropped.
        """
        pending, self.transfer = self.transfer, None
        if pending is None:
            return
        future, max_step = pending
        started = time.perf_counter()
        try:
            transfer = future.result(timeout=self._timeout.total_seconds())
        except Exception as e:  # the transfer outlived the timeout (its own errors are data)
            self._host.report_error(
                TimeoutError(f"state transfer did not finish within {self._timeout}: {e!r}")
            )
            return
        finally:
            self._waited(time.perf_counter() - started)
        for error in transfer.errors:
            self._host.report_error(error)
        self._note_torn(transfer.errors)
        if transfer.recovery_event is not None:
            self.recovery_event = transfer.recovery_event
        if transfer.received is not None and self.healing:
            self.take(transfer.received, max_step)

    def _note_torn(self, errors: list[Exception]) -> None:
        if any(isinstance(e, TornCheckpointError) for e in errors):
            if not self.torn:
                self._log.warning(
                    "a heal into this replica's own tensors failed part way: it will not commit "
                    "or send its state until a heal succeeds"
                )
            self.torn = True

    def check_torn(self) -> None:
        """Training thread, before the vote: a torn replica's step does not commit."""
        if self.torn:
            self._host.report_error(
                RuntimeError(
                    "this replica's state was partly overwritten by a heal that failed; it "
                    "must heal from a peer before it may commit"
                )
            )

    def synchronize(self) -> None:
        """Training thread: waits for the device work of the last transfer (CUDA only)."""
        event, self.recovery_event = self.recovery_event, None
        if event is not None:
            event.synchronize()

    def apply(self) -> None:
        """Training thread: loads the received user state; a failure undoes the heal."""
        pending, self.pending = self.pending, None
        if pending is None:
            if self._host.errored() is None:
                self._host.report_error(RuntimeError("healing without a received checkpoint"))
            return
        try:
            mark("load.begin")
            self._load_user(pending["user"])
            mark("load.end")
            self._log.info("loaded the recovered state dict")
            self.torn = False
            self._healed()
        except Exception as e:
            self._log.exception(f"loading the recovered state dict failed: {e}")
            self._host.report_error(e)
            # Not healed after all: report the old step so the next quorum heals again.
            if self.pre_heal is not None:
                self._host.load_state_dict(self.pre_heal)
        self.pre_heal = None
