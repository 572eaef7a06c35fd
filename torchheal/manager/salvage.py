"""Salvaging the step in flight when a replica group dies during its collectives.

Without salvage, survivors throw away the step a lost group was in. With it, each allreduce's
input is kept (one copy, reused from step to step), and a step aborted for a lost group asks
for a shrink-only quorum of the same step and runs its allreduces again from the kept inputs,
then commits as if the lost group had not been in it. The training loop must read allreduced
tensors only after ``should_commit``, as torchheal's DDP wrappers do; otherwise leave it off.

A survivor that completed the step before the loss commits it as usual; a salvaging survivor in
the same quorum is then behind and heals from it, so all end with the same state. All ranks of
a group redo the step or none does (:func:`~torchheal.manager.machine.salvage_refusal`). Only
the lighthouse's word that a group is lost starts a salvage, never a collective's error alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ReduceOp

from torchheal.manager.failfast import ConnectedQuorum
from torchheal.manager.heal import HealStep
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import NOT_A_LOSS, StepMachine, salvage_refusal
from torchheal.manager.step import StepLedger

__all__ = [
    "LOSS_NOTICE_GRACE_S",
    "NOT_A_LOSS",
    "KeptAllreduce",
    "KeptInputs",
    "Salvage",
    "salvage_refusal",
]

#: How long a failed step waits for the lighthouse's notice that a group is lost before it is
#: given up. A collective often fails first, on the dead group's reset connections, and the
#: notice follows within milliseconds (the lighthouse saw the same connection end); a failure
#: that no loss explains costs a salvaging Manager this much once.
LOSS_NOTICE_GRACE_S = 1.0


@dataclass(frozen=True)
class KeptAllreduce:
    """One allreduce of the step: its tensor, a copy of its input, and how it was asked for."""

    tensor: torch.Tensor
    kept: torch.Tensor
    reduce_op: ReduceOp
    should_quantize: bool


class KeptInputs:
    """The inputs of the step's allreduces, in buffers reused from step to step.

    A training loop reduces the same tensors in the same order every step (DDP's buckets), so
    the ``i``-th allreduce of a step reuses the ``i``-th buffer when it fits: no allocation and
    no page faults after the first step.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self.records: list[KeptAllreduce] = []

    def begin(self) -> None:
        """A new step: nothing kept yet (the buffers stay)."""
        self.records = []

    def keep(self, tensor: torch.Tensor, reduce_op: ReduceOp, should_quantize: bool) -> None:
        """Copies ``tensor`` as it is now, before it is reduced in place."""
        i = len(self.records)
        buf = self._buffers[i] if i < len(self._buffers) else None
        if (
            buf is None
            or buf.shape != tensor.shape
            or buf.dtype != tensor.dtype
            or buf.device != tensor.device
        ):
            buf = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            if i < len(self._buffers):
                self._buffers[i] = buf
            else:
                self._buffers.append(buf)
        buf.copy_(tensor)
        self.records.append(KeptAllreduce(tensor, buf, reduce_op, should_quantize))

    def take(self) -> list[KeptAllreduce]:
        """The step's allreduces, in order; nothing is kept afterwards until :meth:`begin`."""
        records, self.records = self.records, []
        return records


class Salvage:
    """Keeps the step's allreduce inputs and redoes them when the step machine says so.

    Args:
        machine: the Manager's step machine (its ``salvage_refusal`` decides).
        connected: the fail-fast part (why the process group was aborted, if it was).
        ledger: the step's errors and outstanding work.
        heal: the step's heal (a transfer of the failed attempt's quorum is dropped).
        log: the Manager's prefixed logger.
        salvaged: told after a step was redone without a new failure (a counter).
    """

    def __init__(
        self,
        *,
        machine: StepMachine,
        connected: ConnectedQuorum,
        ledger: StepLedger,
        heal: HealStep,
        log: ManagerLogger,
        salvaged: Callable[[], None],
    ) -> None:
        self._machine = machine
        self._connected = connected
        self._ledger = ledger
        self._heal = heal
        self._log = log
        self._salvaged = salvaged
        self.kept = KeptInputs()
        #: The step's allreduces are being redone (none of them is kept again).
        self.replaying = False

    def keep(self, tensor: torch.Tensor, reduce_op: ReduceOp, should_quantize: bool) -> None:
        """Before an allreduce of the step: keeps its input (not while redoing)."""
        if self._machine.salvage and not self.replaying:
            self.kept.keep(tensor, reduce_op, should_quantize)

    def salvageable(self, pg_errored: bool) -> bool:
        """Whether a redo in a new quorum would cure this step (after its collectives ended).

        Args:
            pg_errored: the process group reports an error.
        """
        machine, connected = self._machine, self._connected
        if not machine.salvage:
            return False  # the default: nothing kept, nothing asked
        facts = dict(
            errored=self._ledger.error is not None or pg_errored,
            foreign=self._ledger.foreign_error,
            kept=len(self.kept.records),
        )
        refusal = machine.salvage_refusal(
            aborted_for=connected.aborted_for, dropped=connected.dropped, **facts
        )
        if refusal == NOT_A_LOSS:
            # A collective fails on the dead group's connections before the notice arrives.
            lost = connected.wait_aborted(LOSS_NOTICE_GRACE_S)
            refusal = machine.salvage_refusal(aborted_for=lost, dropped=connected.dropped, **facts)
        if refusal is not None and self._ledger.error is not None:
            self._log.info(f"step {machine.step} not salvaged: {refusal}")
        return refusal is None

    def redo(self, requorum: Callable[[], None], allreduce: Callable[..., Any]) -> None:
        """Redoes the step's allreduces from their kept inputs, in a new quorum of the step.

        Args:
            requorum: asks for and waits for a new quorum of the same step (shrink only).
            allreduce: the Manager's allreduce.
        """
        kept = self.kept.take()
        if not self._machine.salvage:
            # Another rank of the group salvages and this one kept nothing to redo from: its
            # gradients would disagree with theirs. The step fails instead.
            self._ledger.fail(RuntimeError("the group's ranks disagree on salvage_step"))
            return
        why = self._connected.aborted_for or "another rank of the group lost a replica group"
        self._log.warning(
            f"salvaging step {self._machine.step}: {why}; redoing its {len(kept)} allreduces "
            "in a new quorum"
        )
        self._machine.redo()
        self._ledger.drain()  # nothing of the failed attempt may still write into the tensors
        self._heal.drain()  # a transfer of the failed attempt's quorum: dropped
        self._ledger.begin()
        try:
            requorum()
        except Exception as e:
            self._ledger.fail(e)
            return
        self.replaying = True
        try:
            for k in kept:
                k.tensor.copy_(k.kept)
                allreduce(k.tensor, k.should_quantize, k.reduce_op)
        finally:
            self.replaying = False
        self._ledger.settle()
        if self._ledger.error is None:
            self._salvaged()
