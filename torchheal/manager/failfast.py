"""Failing fast: abort the cross-replica process group the moment a group it connects is lost.

The lighthouse says when a group of the current quorum is gone (its session ended, or its
heartbeat expired). Without this, a collective blocked on a frozen or dead group would fail only
at its timeout. :class:`ConnectedQuorum` remembers which quorum the process group was built for
and, told that one of its groups is lost, aborts the group at once: a collective blocked on the
lost group fails now (and with it the step), a later collective of the step fails without being
sent, and the next quorum, whatever its id, rebuilds the group. A step whose collectives had all
completed still commits: its results include the lost group's contribution, the same on every
survivor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from torchheal.manager.log import ManagerLogger

__all__ = ["ConnectedQuorum"]


class ConnectedQuorum:
    """The quorum the cross-replica process group connects, aborted when a member is lost.

    The quorum thread writes it (:meth:`adopt`); the lighthouse's notices arrive on the manager
    server's loop (group rank 0) or the notice thread (other ranks). A lock keeps the id and
    the members consistent between them.

    Args:
        process_group: returns the Manager's current process group (aborted with ``abort()``
            when it has one).
        log: the Manager's prefixed logger.
        aborted: told after each abort (a counter).
    """

    def __init__(
        self, process_group: Callable[[], Any], log: ManagerLogger, aborted: Callable[[], None]
    ) -> None:
        self._process_group = process_group
        self._log = log
        self._aborted = aborted
        self._lock = threading.Lock()
        #: The quorum the process group was configured for (-1: none, or it was aborted).
        self.quorum_id = -1
        #: The replica groups it connects.
        self.members: frozenset[str] = frozenset()

    def adopt(self, quorum_id: int, replica_ids: Iterable[str]) -> None:
        """The process group was rebuilt for ``quorum_id`` with these groups.

        Args:
            quorum_id: the quorum's id.
            replica_ids: its replica groups.
        """
        with self._lock:
            self.quorum_id = quorum_id
            self.members = frozenset(replica_ids)

    def on_member_lost(self, replica_id: str, quorum_id: int, reason: str) -> None:
        """The lighthouse says ``replica_id`` of quorum ``quorum_id`` is gone: stop waiting on it.

        Args:
            replica_id: the lost group.
            quorum_id: the quorum it was lost from.
            reason: why (for the log).
        """
        with self._lock:
            if quorum_id != self.quorum_id or replica_id not in self.members:
                return  # not our group's peer any more (or never was)
            self.quorum_id = -1  # the next quorum, whatever its id, rebuilds the group
            self.members = frozenset()
        self._log.warning(
            f"replica group {replica_id} of quorum {quorum_id} is lost ({reason}): aborting "
            "the cross-replica process group"
        )
        abort = getattr(self._process_group(), "abort", None)
        if abort is not None:
            try:
                abort()
                self._aborted()
            except Exception as e:
                self._log.warning(f"aborting the process group failed: {e}")
