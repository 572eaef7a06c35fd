"""Salvaging the step in flight when a replica group dies during its collectives.

Without salvage, a group lost in the middle of a step costs every survivor that step: the
fail-fast abort makes its allreduces fail, the step does not commit, and the forward and
backward pass it took are thrown away (the reference's "skip the step in flight"). With it,
each allreduce's input is kept (a copy into a buffer reused from step to step), and a step
whose process group was aborted for a lost group is not given up: ``should_commit`` asks for a
new quorum of the same step (shrink only: nobody joins), which the lighthouse forms without the
lost group at once, and the step's allreduces run again from their kept inputs, into the same
tensors, averaged over the new quorum's participants. The step then commits as if the lost
group had not been in it.

What it costs: a copy of every allreduced tensor per step (on an accelerator, a device copy;
on a CPU, a pass over the gradients), and the memory of one copy. What it asks of the training
loop: every tensor given to ``allreduce`` is read only after ``should_commit`` (the optimizer
reads the gradients in place), as torchheal's ``DistributedDataParallel`` (with its default
``gradient_as_bucket_view=True``) and ``PureDistributedDataParallel`` do. A loop that copies a
reduced tensor elsewhere before voting would read the failed step's garbage: leave salvage off.

Consistency with survivors that did not need it: a survivor whose collectives all completed
before the loss commits the step as usual (with the lost group's contribution) and asks for
the next step's quorum. A salvaging survivor in the same quorum is then behind it, so the
quorum makes it heal from that survivor: its collectives run again as a healer's (zeros), it
loads the healthy survivor's state and commits the step the others are at. Either way every
survivor ends the step with the same state.

In a replica group of several ranks, every rank redoes the step or none does: a rank whose
step failed salvageably votes "no, but a redo would cure it" (a torchheal-only field of the
group's vote), and when every "no" of the round says so, the manager server answers "redo" to
all the group's ranks, which redo the step together (those whose own step went well too, from
their kept inputs) and vote again. A group of one rank goes the same way (its own vote
decides). :func:`salvage_refusal` is the rule, kept free of I/O. Only the lighthouse's word
that a group is lost (the process group's fail-fast abort) starts a salvage, never a
collective's error alone: a new quorum cures a lost group, not a flaky link.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

__all__ = ["LOSS_NOTICE_GRACE_S", "NOT_A_LOSS", "KeptAllreduce", "KeptInputs", "salvage_refusal"]

#: The refusal of a step whose failure no lost group explains (yet).
NOT_A_LOSS = "the failure was not the loss of a replica group"

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


def salvage_refusal(
    *,
    enabled: bool,
    errored: bool,
    foreign: bool,
    aborted_for: str | None,
    kept: int,
    healing: bool,
    contributed: bool,
    already_salvaged: bool,
    dropped: bool = False,
) -> str | None:
    """Why this step cannot be salvaged (None: it can).

    Args:
        enabled: the Manager was asked to salvage.
        errored: the step failed.
        foreign: the training loop itself reported a failure (``report_error``): it stands.
        aborted_for: why the process group was aborted (None: it was not, so the failure is
            something else, which a new quorum would not cure).
        kept: allreduces kept this step.
        healing: this replica healed in this step (its inputs were zeros).
        contributed: this replica's data counted in this step.
        already_salvaged: this step was salvaged once already.
        dropped: the process group was aborted because the lighthouse dropped this group
            (frozen past its heartbeat timeout): its peers redid the step without it, and it
            heals instead.
    """
    if not enabled or not errored:
        return "not enabled" if not enabled else "nothing failed"
    if foreign:
        return "the training loop reported an error"
    if already_salvaged:
        return "the step was salvaged once already"
    if healing or not contributed:
        return "this replica did not contribute to the step"
    if kept == 0:
        return "no allreduce was kept"
    if dropped:
        return "this group was dropped from the quorum"
    if aborted_for is None:
        return NOT_A_LOSS  # checked last: the one a short wait may change
    return None
