"""Failing fast: abort the cross-replica process group the moment a group it connects is lost.

What each lighthouse notice does is decided in :class:`~torchheal.manager.machine.Connection`;
:class:`ConnectedQuorum` does it. Without it a collective blocked on a lost group fails only at
its timeout; the abort fails it now, and ends whatever is still pending in that configuration
(:attr:`ConnectedQuorum.expiry`), since Gloo does not always wake such a receive. A step whose
collectives all completed still commits. A notice during a build cuts the build's store
connection (``abandon_configure``: the lost group may host the store, frozen); a build that
fails on its own is reported (``gave_up``) so the other groups' builds end too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torchheal.coordination.types import Notice
from torchheal.futures import Expiry
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import Abort, CancelBuild, Connection, EndHeal
from torchheal.process_group.store import StoreConnections

__all__ = ["ConnectedQuorum", "DroppedError", "MemberLostError"]

#: How often a cancelled build's store connection is looked for again (until the build ends):
#: the notice may come before the build has connected to the store.
_CANCEL_POLL_S = 0.02


class MemberLostError(RuntimeError):
    """A group of the quorum being built is lost: the build is abandoned (the step fails)."""


class DroppedError(MemberLostError):
    """The lighthouse dropped this group from the quorum its collectives run in."""


class _Build:
    """One process-group build in progress: its quorum and how to abandon it."""

    def __init__(
        self,
        quorum_id: int,
        members: frozenset[str],
        store_port: int,
        abandon: Callable[[], None],
    ) -> None:
        self.quorum_id = quorum_id
        self.members = members
        self._abandon = abandon
        self._store = StoreConnections(store_port)
        self.ended = threading.Event()
        # A cut and the build's end exclude each other: once the build has ended, no cut is
        # under way that could catch the next build's fresh connection to the same store.
        self._cutting = threading.Lock()

    def cancel(self) -> None:
        """Tells the process group to give up its store connection, and cuts that connection
        now and whenever it appears, until the build ends."""
        while True:
            with self._cutting:
                if self.ended.is_set():
                    return
                try:  # first: the attempt the cut fails must find it abandoned
                    self._abandon()
                except Exception:  # a group of the user's that cannot be told: cuts only
                    pass
                self._store.cut()
            if self.ended.wait(_CANCEL_POLL_S):
                return

    def end(self) -> None:
        """The build is over (waits for a cut under way)."""
        with self._cutting:
            self.ended.set()


class ConnectedQuorum:
    """Does what :class:`~torchheal.manager.machine.Connection` decides for each notice.

    The quorum thread adopts and builds; the lighthouse's notices arrive on the manager
    server's loop (group rank 0) or the notice thread (other ranks). One lock keeps the
    decisions in order between them; the doing (aborts, cuts) happens outside it.

    Args:
        process_group: returns the Manager's current process group (aborted with ``abort()``
            when it has one).
        log: the Manager's prefixed logger.
        aborted: told after each abort (a counter).
        gave_up: told ``(quorum_id, reason)`` when a build fails on its own (not abandoned for
            a notice): the other groups wait in it for this rank's address, so the lighthouse
            must tell them (``GroupEndpoints.gave_up``).
    """

    def __init__(
        self,
        process_group: Callable[[], Any],
        log: ManagerLogger,
        aborted: Callable[[], None],
        gave_up: Callable[[int, str], None] | None = None,
    ) -> None:
        self._process_group = process_group
        self._gave_up = gave_up
        self._log = log
        self._aborted = aborted
        self._lock = threading.Lock()
        self._core = Connection()
        self._aborted_event = threading.Event()  # set when aborted_for is
        #: Ends the collectives of the configuration adopted last when it is aborted.
        self.expiry = Expiry()
        self._build: _Build | None = None

    @property
    def quorum_id(self) -> int:
        """The quorum the process group was configured for (-1: none, or it was aborted)."""
        return self._core.quorum_id

    @quorum_id.setter
    def quorum_id(self, quorum_id: int) -> None:  # the reference's tests set it
        self._core.quorum_id = quorum_id

    @property
    def members(self) -> frozenset[str]:
        """The replica groups it connects."""
        return self._core.members

    @property
    def aborted_for(self) -> str | None:
        """Why the process group was last aborted, or its build abandoned, until the next
        quorum's group is adopted: a collective that then fails to start is expected."""
        return self._core.aborted_for

    @property
    def dropped(self) -> bool:
        """Whether that abort was for this group's own drop."""
        return self._core.dropped

    def wait_aborted(self, timeout_s: float) -> str | None:
        """Waits up to ``timeout_s`` for the group to be aborted for a lost member.

        Returns:
            :attr:`aborted_for` then (None: no abort came).
        """
        self._aborted_event.wait(timeout_s)
        return self.aborted_for

    @contextmanager
    def building(
        self, quorum_id: int, replica_ids: Iterable[str], store_port: int
    ) -> Iterator[None]:
        """Around the process group's build for ``quorum_id``: abandoned if a member is lost.

        Args:
            quorum_id: the quorum being built.
            replica_ids: its replica groups.
            store_port: the port of its rendezvous store.

        Raises:
            MemberLostError: a member was lost before or during the build.
        """
        build = _Build(quorum_id, frozenset(replica_ids), store_port, self._abandon_configure)
        with self._lock:
            lost = self._core.start_build(quorum_id, build.members)
            if lost is None:
                self._build = build
        if lost is not None:
            raise self._abandoned(
                f"replica group {lost} of quorum {quorum_id} was lost before its process "
                "group was built"
            )
        try:
            yield
        except Exception as e:
            with self._lock:
                lost = self._core.build.lost if self._core.build is not None else None
            if lost is not None:
                raise self._abandoned(
                    f"replica group {lost} of quorum {quorum_id} was lost while its "
                    f"process group was being built (the build was abandoned: {e})"
                ) from e
            # Given up for a reason of its own: the other groups wait for our address.
            if self._gave_up is not None:
                self._gave_up(quorum_id, f"{type(e).__name__}: {e}")
            raise
        finally:
            with self._lock:
                self._core.end_build()
                self._build = None
            build.end()

    def _abandon_configure(self) -> None:
        abandon = getattr(self._process_group(), "abandon_configure", None)
        if abandon is not None:  # (a reference group has none: the cut alone)
            abandon()

    def _abandoned(self, why: str) -> MemberLostError:
        # No group to abort, but the same word from the lighthouse: the step failed for a loss.
        with self._lock:
            self._core.abandoned(why)
            self._aborted_event.set()
        return MemberLostError(why)

    def adopt(self, quorum_id: int, replica_ids: Iterable[str]) -> None:
        """The process group was rebuilt for ``quorum_id`` with these groups.

        Args:
            quorum_id: the quorum's id.
            replica_ids: its replica groups.
        """
        with self._lock:
            abort = self._core.adopt(quorum_id, frozenset(replica_ids))
            expiry = self.expiry
            if abort is None:
                self._aborted_event.clear()
                self.expiry = Expiry()
                return
        self._abort(abort, expiry)

    def on_notice(self, notice: Notice, end_heal: Callable[[EndHeal], None], step: int = 0) -> None:
        """Does what ``Connection.on_notice`` decides for a lighthouse notice.

        Args:
            notice: the notice.
            end_heal: ends a heal from a lost group (the Manager's recovery).
            step: this rank's step (its committed steps).
        """
        with self._lock:
            actions = self._core.on_notice(notice, step)
            # This configuration's, not the next one's, which may be adopted before we end it.
            expiry, build = self.expiry, self._build
        for action in actions:
            if isinstance(action, EndHeal):
                end_heal(action)
            elif isinstance(action, Abort):
                self._abort(action, expiry)
            elif build is not None:
                self._cancel(action, build)

    def _cancel(self, action: CancelBuild, build: _Build) -> None:
        if action.dropped:
            self._log.warning(
                f"this group was dropped from quorum {action.quorum_id} while its cross-replica "
                "process group was being built: abandoning the build"
            )
        else:
            self._log.warning(
                f"replica group {action.replica_id} of quorum {action.quorum_id} is lost while "
                "the cross-replica process group is being built: abandoning the build"
            )
        threading.Thread(target=build.cancel, name="torchheal-cancel-build", daemon=True).start()

    def _abort(self, action: Abort, expiry: Expiry) -> None:
        """Aborts the process group of the action's quorum and ends what is pending in it."""
        error = (DroppedError if action.dropped else MemberLostError)(action.why)
        self._aborted_event.set()
        log = self._log.info if action.routine else self._log.warning
        log(f"{action.why}: aborting the cross-replica process group")
        abort = getattr(self._process_group(), "abort", None)
        if abort is not None:
            try:
                abort()
                self._aborted()
            except Exception as e:
                self._log.warning(f"aborting the process group failed: {e}")
        # After the abort, whose cut makes sure no late data lands in the tensors: whatever
        # is still pending of the group's collectives ends now, not at its timeout.
        ended = expiry.expire(error)
        if ended:
            self._log.info(f"ended {ended} collective(s) pending in quorum {action.quorum_id}")
