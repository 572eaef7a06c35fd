"""The Manager's collectives: which collective runs, the average after it, and its failures.

The process group only sums: an AVG across replicas is a SUM divided afterwards by the number
of *participating* replicas (healers and spares send zeros and are not counted), which the
process group cannot know. The division runs in the returned work's future, so whoever waits
on the work sees the average. Quantized data goes through
:func:`~torchheal.collectives.allreduce_quantized` (torch ops shipped with torchheal, so
always available; the reference needs triton for it).

:class:`ManagerCollectives` holds the Manager's ``allreduce``, ``report_error``, ``errored``
and ``wrap_future``: a failure is reported to the step's ledger and makes the step not commit.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import AllreduceOptions, ReduceOp

from torchheal.collectives import allreduce_quantized
from torchheal.futures import Expiry, timed_then
from torchheal.manager.failfast import ConnectedQuorum
from torchheal.manager.heal import HealStep
from torchheal.manager.salvage import Salvage
from torchheal.manager.step import ExceptionWithTraceback, StepLedger
from torchheal.manager.telemetry import Telemetry
from torchheal.process_group.work import _DummyWork, _ErrorRecordingWork
from torchheal.work import StepSink, _ManagedWork

__all__ = ["IS_TRITON_AVAILABLE", "ManagerCollectives", "averaging", "start_allreduce"]

T = TypeVar("T")

#: Name kept from the reference, where quantized collectives need triton; ours are torch ops
#: that ship with torchheal, so they are always available.
IS_TRITON_AVAILABLE: bool = True


def start_allreduce(
    pg: Any, tensor: torch.Tensor, reduce_op: ReduceOp, should_quantize: bool
) -> torch.distributed.Work:
    """Starts an in-place allreduce of ``tensor`` on ``pg``; AVG is sent as a SUM.

    Args:
        pg: the cross-replica process group.
        tensor: the tensor to reduce in place.
        reduce_op: the Manager's reduction (AVG becomes SUM; see :func:`averaging`).
        should_quantize: send 8-bit quantized data.

    Raises:
        Exception: whatever the process group raises when the collective cannot start.
    """
    pg_op = ReduceOp.SUM if reduce_op == ReduceOp.AVG else reduce_op
    if should_quantize and IS_TRITON_AVAILABLE:
        stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
        return allreduce_quantized([tensor], pg_op, pg, stream)
    opts = AllreduceOptions()
    opts.reduceOp = pg_op
    return pg.allreduce([tensor], opts)


def averaging(
    tensor: torch.Tensor, divisor: int
) -> Callable[[torch.futures.Future[Any]], torch.Tensor]:
    """The callback that turns a finished SUM into an average (chain it with ``then``).

    Args:
        tensor: the reduced tensor (divided in place).
        divisor: the number of participating replicas; 1 or less leaves the tensor alone
            (x / 1 == x: no pass over the tensor). The tensor is multiplied by ``1 / divisor``
            (exact for powers of two; otherwise within one rounding of a division).
    """

    # A multiplication by the reciprocal, as torch's DDP averages: cheaper than a division on
    # CPU, and this pass is on the step's critical path.
    scale = 1.0 / divisor

    def normalize(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # surfaces an error of the collective
        if divisor > 1:
            tensor.mul_(scale)
        return tensor

    return normalize


def _value(f: torch.futures.Future[T]) -> T:
    return f.value()


class ManagerCollectives(StepSink):
    """The Manager's collectives and step errors (part of ``Manager``, whose ``wait_quorum``,
    ``num_participants`` and ``is_participating`` they use); the :class:`StepSink` its managed
    works are handed."""

    _pg: Any
    _ledger: StepLedger
    _heal: HealStep
    _salvage: Salvage
    _connected: ConnectedQuorum
    _telemetry: Telemetry
    _timeout: timedelta

    def fail_step(
        self,
        e: Exception,
        foreign: bool = False,
        how: str = "step failed",
        trace: bool = False,
        cause: bool = True,
    ) -> None:
        """Fails the step (``StepLedger.fail``; part of :class:`~torchheal.work.StepSink`).

        Args:
            e: what failed.
            foreign: the failure is the loop's own, not the step's collectives'.
            how: what failed, for the log.
            trace: log the traceback.
            cause: the error may explain the step's failure (else only counted).
        """
        self._ledger.fail(e, foreign, how, trace, cause)

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
        self._salvage.keep(tensor, reduce_op, should_quantize)  # before it is reduced
        if self.errored():
            self._ledger.skipped += 1  # the divergence guard's exchange is skipped too
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
                self.fail_step(e, how=how, cause=False)
            else:
                self.fail_step(e, how="allreduce failed to start", trace=True)
            return _DummyWork(tensor)

        # Counts this allreduce's failure once, whether wait() or its future reports it.
        work = _ErrorRecordingWork(work, self._telemetry.allreduce_error_counter())
        managed = _ManagedWork(self, work, tensor, expiry, step=self)
        managed.get_future().then(averaging(tensor, num_participants if is_avg else 1))
        self._ledger.track_work(managed)
        return managed

    def report_error(self, e: Exception) -> None:
        """Marks this step as failed: it will not commit, and the PG is rebuilt next step.

        Args:
            e: what failed.
        """
        self.fail_step(e, foreign=True)

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
        return self.wrap_future_then(fut, _value, default, timeout, foreign=True)

    def wrap_future_then(
        self,
        fut: torch.futures.Future[Any],
        then: Callable[[torch.futures.Future[Any]], T],
        default: T,
        timeout: timedelta | None = None,
        foreign: bool = False,
        expiry: Expiry | None = None,
    ) -> torch.futures.Future[T]:
        """``wrap_future(fut.then(then), default)`` in one callback on ``fut`` (part of
        :class:`~torchheal.work.StepSink`): it runs for every gradient bucket, on the thread
        completing its collective.

        Args:
            fut: the future to wrap.
            then: the continuation.
            default: the value when ``fut`` or ``then`` fails, times out or expires.
            timeout: defaults to the manager's ``timeout``.
            foreign: the failure is the loop's own: a salvage would not redo it.
            expiry: ends the wait early (the process group was aborted for its quorum).
        """

        def callback(f: torch.futures.Future[Any]) -> T:
            try:
                return then(f)
            except Exception as e:
                # The loop's own futures may fail for a bug: their first failure keeps its trace.
                self.fail_step(e, foreign, "future failed, skipping the step", trace=foreign)
                return default

        wrapped = timed_then(fut, timeout or self._timeout, callback, expiry)
        self._ledger.track_future(wrapped)
        return wrapped
