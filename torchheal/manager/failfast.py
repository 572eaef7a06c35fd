"""Failing fast: abort the cross-replica process group the moment a group it connects is lost.

The lighthouse says when a group of the current quorum is gone (its session ended, or its
heartbeat expired). Without this, a collective blocked on a frozen or dead group would fail only
at its timeout. :class:`ConnectedQuorum` remembers which quorum the process group was built for
and, told that one of its groups is lost, aborts the group at once: a collective blocked on the
lost group fails now (and with it the step), a later collective of the step fails without being
sent, and the next quorum, whatever its id, rebuilds the group. A step whose collectives had all
completed still commits: its results include the lost group's contribution, the same on every
survivor. The abort also ends whatever is still pending in that configuration (:attr:`expiry
<ConnectedQuorum.expiry>`): the cut wakes a blocked Gloo collective on the survivors' side, but
not always on the side of a group woken from a freeze, which the lighthouse dropped meanwhile
(:meth:`ConnectedQuorum.on_dropped`).

A group can also be lost while the process group is being built for its quorum (it died right after
the quorum was issued, before it published its rendezvous address): the build would wait for it
until the group's timeout. :meth:`ConnectedQuorum.building` covers that window: the notice cuts the
build's connection to the rendezvous store, so the build fails at once (and with it the step). The
lost group may host that store, frozen: it accepts connections and never answers, and c10d's store
client tries a cut connection again until its timeout. So the notice also tells the process group
to give up its store connection (``abandon_configure``), which for Gloo also ends its pairs' waits
for a peer past the rendezvous that will never connect (one that gave up after it published its
address, as the notice's own group may: Gloo would wait five times its timeout). A notice that came
before the build starts fails it before it begins, and one that the build outran aborts the group
as soon as it is adopted. Every rank of every surviving group is told, so each rank's group for
that quorum ends one of these three ways and none is left waiting in a rendezvous for a rank that
gave up on it.

A build can also fail on its own (its store connection failed, a local error): the other groups
would wait in the rendezvous for this rank's address until their timeout, and nobody is lost.
:meth:`ConnectedQuorum.building` then reports it (``gave_up``): the lighthouse tells the other
groups, as if this one were lost from that quorum, and their builds end one of the three ways
above.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torchheal.futures import Expiry
from torchheal.manager.log import ManagerLogger
from torchheal.process_group.gloo_sockets import PairSockets

__all__ = ["ConnectedQuorum", "DroppedError", "MemberLostError"]

#: Quorums whose lost groups are remembered (a notice may come before its quorum is built).
_REMEMBERED_QUORUMS = 16
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
        self.store_port = store_port
        self._abandon = abandon
        self.before = PairSockets.before()
        self.ended = threading.Event()
        self.lost: str | None = None
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
                PairSockets.to_port(self.before, self.store_port).cut()
            if self.ended.wait(_CANCEL_POLL_S):
                return

    def end(self) -> None:
        """The build is over (waits for a cut under way)."""
        with self._cutting:
            self.ended.set()


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
        #: The quorum the process group was configured for (-1: none, or it was aborted).
        self.quorum_id = -1
        #: The replica groups it connects.
        self.members: frozenset[str] = frozenset()
        #: Why the process group was last aborted, or its build abandoned (the lost group and
        #: the reason), until the next quorum's group is adopted: a collective that then fails
        #: to start is expected.
        self.aborted_for: str | None = None
        self._aborted_event = threading.Event()  # set with aborted_for
        #: Whether that abort was for this group's own drop (no redo in a new quorum cures it).
        self.dropped = False
        #: Ends the collectives of the configuration adopted last when it is aborted: one
        #: woken from a freeze may wait on a peer's data that will never come, and Gloo does not
        #: always wake it when the peer's connection closes.
        self.expiry = Expiry()
        self._lost: dict[int, set[str]] = {}
        self._build: _Build | None = None

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
            lost = self._lost.get(quorum_id, set()) & build.members
            if not lost:
                self._build = build
        if lost:
            raise self._abandoned(
                f"replica group {sorted(lost)[0]} of quorum {quorum_id} was lost before its "
                "process group was built"
            )
        try:
            yield
        except Exception as e:
            if build.lost is not None:
                raise self._abandoned(
                    f"replica group {build.lost} of quorum {quorum_id} was lost while its "
                    f"process group was being built (the build was abandoned: {e})"
                ) from e
            # Given up for a reason of its own: the other groups wait for our address.
            if self._gave_up is not None:
                self._gave_up(quorum_id, f"{type(e).__name__}: {e}")
            raise
        finally:
            with self._lock:
                self._build = None
            build.end()

    def _abandon_configure(self) -> None:
        abandon = getattr(self._process_group(), "abandon_configure", None)
        if abandon is not None:  # (a reference group has none: the cut alone)
            abandon()

    def _abandoned(self, why: str) -> MemberLostError:
        # No group to abort, but the same word from the lighthouse: the step failed for a loss.
        with self._lock:
            self.aborted_for = why
            self._aborted_event.set()
        return MemberLostError(why)

    def adopt(self, quorum_id: int, replica_ids: Iterable[str]) -> None:
        """The process group was rebuilt for ``quorum_id`` with these groups.

        Args:
            quorum_id: the quorum's id.
            replica_ids: its replica groups.
        """
        members = frozenset(replica_ids)
        with self._lock:
            lost = self._lost.get(quorum_id, set()) & members
            if not lost:
                self.quorum_id = quorum_id
                self.members = members
                self.aborted_for = None
                self.dropped = False
                self._aborted_event.clear()
                self.expiry = Expiry()
                return
            self.quorum_id = -1
            self.members = frozenset()
            expiry = self.expiry
        # Lost while the build ran to its end anyway: the group must not be used.
        self._abort(sorted(lost)[0], quorum_id, "before the process group was adopted", expiry)

    def on_member_lost(self, replica_id: str, quorum_id: int, reason: str) -> None:
        """The lighthouse says ``replica_id`` of quorum ``quorum_id`` is gone: stop waiting on it.

        Args:
            replica_id: the lost group.
            quorum_id: the quorum it was lost from.
            reason: why (for the log).
        """
        with self._lock:
            self._remember_lost(replica_id, quorum_id)
            build = self._build
            if build is not None and build.quorum_id == quorum_id and replica_id in build.members:
                if build.lost is not None:
                    return  # already being abandoned
                build.lost = replica_id
            else:
                build = None
                if quorum_id != self.quorum_id or replica_id not in self.members:
                    return  # not our group's peer any more (or not yet: remembered)
                self.quorum_id = -1  # the next quorum, whatever its id, rebuilds the group
                self.members = frozenset()
            # This configuration's, not the next one's, which may be adopted before we end it.
            expiry = self.expiry
        if build is not None:
            self._log.warning(
                f"replica group {replica_id} of quorum {quorum_id} is lost ({reason}) while "
                "the cross-replica process group is being built: abandoning the build"
            )
            threading.Thread(
                target=build.cancel, name="torchheal-cancel-build", daemon=True
            ).start()
            return
        self._abort(replica_id, quorum_id, reason, expiry)

    def on_dropped(
        self, replica_id: str, quorum_id: int, reason: str, superseded: bool = False
    ) -> None:
        """The lighthouse dropped this group from quorum ``quorum_id``: a build for that quorum
        is abandoned, as its peers abandoned it, whether it is under way or starts later, and a
        group built for it is aborted.

        A drop (the group was frozen past its heartbeat timeout, or its session ended) means
        the peers redid the step without this group: its collectives in that quorum can never
        count (the vote's fence, ``standing.py``, overrules a commit), and once woken one may
        wait on a peer's data that never comes, until its timeout (Gloo does not always wake a
        receive when the peer's connection closes). So the group is aborted and what is pending
        in it ends at once (:attr:`expiry`); the release of the old group, which would wait for
        that receive, happens off this thread (``ProcessGroupWrapper.abort``).

        A group left out of a newer quorum while still at work in this one (``superseded``)
        keeps its group: its peers completed the step with it before they moved on, so its
        collectives complete too, and its step commits as theirs did.

        Args:
            replica_id: this group's full id.
            quorum_id: the quorum it was dropped from.
            reason: why (for the log).
            superseded: it was left out of a newer quorum, not dropped.
        """
        with self._lock:
            self._remember_lost(replica_id, quorum_id)  # a build that starts later fails
            build = self._build
            if build is not None:
                if build.quorum_id != quorum_id or build.lost is not None:
                    return  # (a build of another quorum released the group in use already)
                build.lost = replica_id
            else:
                if superseded or quorum_id != self.quorum_id:
                    return
                self.quorum_id = -1  # the next quorum, whatever its id, rebuilds the group
                self.members = frozenset()
            expiry = self.expiry
        if build is None:
            self._abort(replica_id, quorum_id, reason, expiry, dropped=True)
            return
        self._log.warning(
            f"this group was dropped from quorum {quorum_id} ({reason}) while its "
            "cross-replica process group was being built: abandoning the build"
        )
        threading.Thread(target=build.cancel, name="torchheal-cancel-build", daemon=True).start()

    def _remember_lost(self, replica_id: str, quorum_id: int) -> None:
        """Under the lock: a build of ``quorum_id`` with ``replica_id`` fails before it begins."""
        self._lost.setdefault(quorum_id, set()).add(replica_id)
        while len(self._lost) > _REMEMBERED_QUORUMS:
            del self._lost[min(self._lost)]

    def _abort(
        self,
        replica_id: str,
        quorum_id: int,
        reason: str,
        expiry: Expiry,
        dropped: bool = False,
    ) -> None:
        """Aborts the process group of ``quorum_id`` and ends what is pending in it (``expiry``,
        that configuration's)."""
        if dropped:
            self.aborted_for = f"this group was dropped from quorum {quorum_id} ({reason})"
            error: MemberLostError = DroppedError(self.aborted_for)
            log = self._log.warning
        else:
            # A peer that said goodbye finished its job: the abort is routine (INFO), as the
            # lighthouse logs it; a peer that vanished is a failure (WARNING).
            self.aborted_for = (
                f"replica group {replica_id} of quorum {quorum_id} is lost ({reason})"
            )
            error = MemberLostError(self.aborted_for)
            log = self._log.info if reason.startswith("left") else self._log.warning
        self.dropped = dropped
        self._aborted_event.set()
        log(f"{self.aborted_for}: aborting the cross-replica process group")
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
            self._log.info(f"ended {ended} collective(s) pending in quorum {quorum_id}")
