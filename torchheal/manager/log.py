"""The Manager's log lines: one prefix per rank, and the description of a new quorum."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torchheal.coordination.plan import Participation
from torchheal.coordination.types import QuorumResult

__all__ = ["ManagerLogger", "describe_quorum"]

# The package name, so users configuring "torchheal.manager" logging see these lines.
logger: logging.Logger = logging.getLogger("torchheal.manager")


class ManagerLogger:
    """Prefixes every line with ``[{replica_id}/{group_rank} - step {step}]``.

    Args:
        current_step: returns the step to show (read when a line is written).
        replica_id: the replica group's full id.
        group_rank: this rank's index in its group.
    """

    def __init__(self, current_step: Callable[[], int], replica_id: str, group_rank: int) -> None:
        self._current_step = current_step
        self._replica_id = replica_id
        self._group_rank = group_rank

    def prefix(self) -> str:
        """The prefix of the next line."""
        return f"[{self._replica_id}/{self._group_rank} - step {self._current_step()}]"

    def log(self, level: int, msg: str, *args: object) -> None:
        """Logs ``msg % args``; nothing is formatted when ``level`` is disabled (per-step lines)."""
        if logger.isEnabledFor(level):
            logger.log(level, "%s %s", self.prefix(), msg % args if args else msg)

    def info(self, msg: str) -> None:
        """Logs at INFO."""
        logger.info("%s %s", self.prefix(), msg)

    def warning(self, msg: str, exc_info: BaseException | None = None) -> None:
        """Logs at WARNING, with ``exc_info``'s traceback where given."""
        logger.warning("%s %s", self.prefix(), msg, exc_info=exc_info)

    def debug(self, msg: str) -> None:
        """Logs at DEBUG; nothing is formatted when DEBUG is off."""
        self.log(logging.DEBUG, msg)

    def exception(self, msg: str) -> None:
        """Logs at ERROR with the exception being handled."""
        logger.exception("%s %s", self.prefix(), msg)


def describe_quorum(quorum: QuorumResult, taking_part: Participation) -> str:
    """One line for a new quorum: membership, progress, and this replica's part in it.

    Args:
        quorum: this rank's quorum result.
        taking_part: this replica's participation in the step.
    """
    line = (
        f"new quorum {quorum.quorum_id}: replica rank {quorum.replica_rank} of "
        f"{quorum.replica_world_size} {list(quorum.replica_ids)}, max_step {quorum.max_step}, "
        f"participating rank {taking_part.rank} of {taking_part.count}, heal={quorum.heal}"
    )
    if quorum.heal:
        line += (
            f" from replica rank {quorum.recover_src_replica_rank}"
            f" ({quorum.recover_src_manager_address})"
        )
    if quorum.recover_dst_replica_ranks:
        line += f", sending to replica ranks {list(quorum.recover_dst_replica_ranks)}"
    return line
