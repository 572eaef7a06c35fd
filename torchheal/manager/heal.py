"""A replica's heal, on the training thread's side: what arrived, when to load it, the warm-up.

The quorum thread decides who heals and moves the state
(:class:`~torchheal.manager.quorum_worker.QuorumWorker`); :class:`HealStep` keeps the result until
the training thread loads it, in ``start_quorum`` or (asynchronous quorum) ``should_commit``.
Loading only on the training thread is a deliberate difference from the reference, whose quorum
thread loads during the forward pass and breaks FSDP2/DTensor models.

A healer may receive beside the step's collectives (contributing zeros); ``should_commit`` waits
for the transfer (:meth:`HealStep.settle`). A replica at step 0 that never committed receives
straight into its own tensors; if that fails part way it is *torn* (``StepMachine.torn``) until a
later heal succeeds. A group that (re)starts into a running job takes its first, slowest step
alone (the warm-up), so the others do not wait for it in the collectives.

The decisions are the step machine's (:class:`~torchheal.manager.machine.StepMachine`);
:class:`HealStep` only waits and loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Protocol

from torchheal.checkpointing.timeline import mark
from torchheal.checkpointing.transport import TornCheckpointError
from torchheal.coordination.types import QuorumResult
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import StepMachine
from torchheal.manager.quorum_worker import QuorumOutcome, Transfer

__all__ = ["HealHost", "HealStep"]


class HealHost(Protocol):
    """What a heal needs of its Manager: to fail its step, and to read its step's error."""

    def report_error(self, e: Exception) -> None: ...

    def errored(self) -> object: ...


class HealStep:
    """One step's heal as the training thread sees it: the transfer, the load, the warm-up.

    What :meth:`take_outcome` writes from the quorum thread is read by the training thread
    only after it has waited for that quorum.

    Args:
        host: the Manager (failures are reported to it).
        machine: the Manager's step machine (it decides; this does).
        load_user: loads the received user state (``StateRegistry.load``).
        timeout: how long ``should_commit`` waits for a transfer that runs beside the step.
        waited: told how long the training thread waited for a transfer (seconds).
        log: the Manager's prefixed logger.
        healed: told after a heal's state was loaded (the manager server reports it).
    """

    def __init__(
        self,
        *,
        host: HealHost,
        machine: StepMachine,
        load_user: Callable[[Any], None],
        timeout: timedelta,
        waited: Callable[[float], None],
        log: ManagerLogger,
        healed: Callable[[], None] = lambda: None,
    ) -> None:
        self._host = host
        self._machine = machine
        self._healed = healed
        self._load_user = load_user
        self._timeout = timeout
        self._waited = waited
        self._log = log
        #: The received state (``{"user", "torchft"}``) waiting for the training thread.
        self.pending: dict[str, Any] | None = None
        #: A CUDA event after the last transfer (None without CUDA).
        self.recovery_event: Any = None
        #: The transfer running beside the step's collectives, with the quorum's max step.
        self.transfer: tuple[Future[Transfer], int] | None = None
        #: The last quorum result taken (the divergence guard reads it).
        self.quorum: QuorumResult | None = None

    @property
    def warming_up(self) -> bool:
        """This step is the warm-up (its collectives are local no-ops)."""
        return self._machine.warming_up

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
        self.pending = None
        if not self._machine.begin():
            return False
        mark("warmup.begin")
        self._log.info("joining a running job: warming up with one local step first")
        return True

    def end_warmup(self) -> bool:
        """Training thread, ``should_commit``: ends the warm-up step.

        Returns:
            True when this step was the warm-up (it is not voted on).
        """
        if not self._machine.end_warmup():
            return False
        mark("warmup.end")
        self._log.info("warm-up step done (not committed); the next step joins the quorum")
        return True

    def take_outcome(self, outcome: QuorumOutcome) -> None:
        """Quorum thread: keeps the heal part of the step's quorum work."""
        self._note_torn(outcome.errors)
        self.quorum = outcome.quorum
        max_step = outcome.quorum.max_step
        if self._machine.quorum_taken(
            outcome.participation, healing=outcome.healing, max_step=max_step
        ):
            self._log.warning(
                "this replica's initial state was partly overwritten by a heal that failed, "
                "and it is now the quorum's source at step 0: its state becomes the initial "
                "state the others sync to"
            )
        if outcome.recovery_event is not None:
            self.recovery_event = outcome.recovery_event
        if outcome.transfer is not None:
            # Runs beside the step's collectives; should_commit waits for it.
            self.transfer = (outcome.transfer, max_step)
        if outcome.healing and outcome.received is not None:
            self.take(outcome.received, max_step)

    def take(self, received: dict[str, Any], max_step: int) -> None:
        """Keeps what arrived for the training thread; the counters become the sender's now,
        as the reference does (the user state waits for the training thread).

        Args:
            received: the state that arrived (``{"user", "torchft"}``).
            max_step: the quorum's step, which the healer joins.
        """
        self.pending = received
        self._machine.heal_arrived(received["torchft"]["batches_committed"], max_step)

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
        if transfer.received is not None and self._machine.healing:
            self.take(transfer.received, max_step)

    def _note_torn(self, errors: list[Exception]) -> None:
        if any(isinstance(e, TornCheckpointError) for e in errors) and self._machine.tore():
            self._log.warning(
                "a heal into this replica's own tensors failed part way: it will not commit "
                "or send its state until a heal succeeds"
            )

    def check_torn(self) -> None:
        """Training thread, before the vote: a torn replica's step does not commit."""
        why = self._machine.torn_error()
        if why is not None:
            self._host.report_error(RuntimeError(why))

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
        except Exception as e:
            self._log.exception(f"loading the recovered state dict failed: {e}")
            self._host.report_error(e)
            # Not healed after all: the old step is reported, so the next quorum heals again.
            self._machine.loaded(ok=False)
            return
        self._log.info("loaded the recovered state dict")
        self._machine.loaded(ok=True)
        self._healed()
