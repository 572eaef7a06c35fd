"""The Manager's per-step decisions as pure functions (no I/O, no threads, no clock).

Who contributes to this step's allreduce and with which rank, whether this rank votes to commit,
and when repeated failed commits become fatal: every rule the Manager applies to a quorum result
lives here, so it can be read and tested without a lighthouse.
"""

from __future__ import annotations

from enum import Enum

from torchheal.coordination.types import QuorumResult


class WorldSizeMode(Enum):
    """How the number of replicas contributing to a step is chosen.

    DYNAMIC: every up-to-date replica contributes; gradients are averaged over their count.
    FIXED_WITH_SPARES: at most ``min_replica_size`` replicas contribute; replicas whose
        participating rank is ``>= min_replica_size`` are spares that contribute zeros.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


def participation(
    result: QuorumResult,
    use_async_quorum: bool,
    allow_heal: bool,
    world_size_mode: WorldSizeMode,
    min_replica_size: int,
) -> tuple[int | None, int]:
    """Returns ``(participating rank or None, number of participants)`` for one step.

    With asynchronous quorum a healing replica receives its state while the others already run
    the forward pass, so only the up-to-date replicas (``max_*``) contribute this step; the same
    holds when healing is not allowed. With synchronous quorum healing completes before the
    forward pass and every replica in the quorum contributes.

    Args:
        result: this rank's quorum result.
        use_async_quorum: whether the Manager runs the quorum in the background.
        allow_heal: the ``start_quorum`` argument of this step.
        world_size_mode: DYNAMIC or FIXED_WITH_SPARES.
        min_replica_size: the Manager's ``min_replica_size``.
    """
    if use_async_quorum or not allow_heal:
        rank, world_size = result.max_replica_rank, result.max_world_size
    else:
        rank, world_size = result.replica_rank, result.replica_world_size
    if world_size_mode == WorldSizeMode.FIXED_WITH_SPARES:
        world_size = min(world_size, min_replica_size)
        if rank is not None and rank >= min_replica_size:
            rank = None  # a spare: contributes zeros
    return rank, world_size


def local_commit_vote(num_participants: int, min_replica_size: int, errored: bool) -> bool:
    """This rank's vote: enough replicas took part and nothing failed in this step.

    Args:
        num_participants: participating replicas this step.
        min_replica_size: the Manager's ``min_replica_size``.
        errored: whether an error was reported during the step.
    """
    return num_participants >= min_replica_size and not errored


def commit_failures_exceeded(commit_failures: int, max_retries: int | None) -> str | None:
    """Returns the fatal error message once consecutive failed commits exceed ``max_retries``.

    Args:
        commit_failures: consecutive failed commits including the current one.
        max_retries: the Manager's ``max_retries`` (None: retry forever).
    """
    if max_retries is not None and commit_failures > max_retries:
        return (
            f"should_commit failed {commit_failures} times consecutively, "
            f"exceeding max_retries={max_retries}"
        )
    return None
