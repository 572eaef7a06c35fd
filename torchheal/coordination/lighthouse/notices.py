"""The groups' live sessions with the lighthouse, and the ``MemberLost`` notices they hear.

A session's end is its group's death certificate. Every live session is told when a member of the
current quorum is lost (once per member and quorum id), so peers can abort a collective blocked on
it. A group that missed its own notice hears it when it reopens a session; a live member left out
of the next quorum is told too, so it stops waiting. Loop thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination.lighthouse.rounds import QuorumRounds
from torchheal.coordination.lighthouse.session import Peer
from torchheal.coordination.quorum import (
    GAVE_UP_REASON,
    left_out,
    lost_members,
    session_ended,
    session_opened,
)
from torchheal.coordination.types import Quorum

__all__ = ["Peer", "SessionRegistry"]

#: Groups whose loss is remembered for :meth:`SessionRegistry.missed` (one entry per group).
_REMEMBERED_LOST = 4096

# A child of the lighthouse's logger, so configuring that one configures the whole lighthouse.
logger: logging.Logger = logging.getLogger("torchheal.coordination.lighthouse.notices")


class SessionRegistry:
    """Live sessions by group (a newer one replaces an older), and the lost-member notices."""

    def __init__(self, rounds: QuorumRounds, notify: Callable[..., None], observed: bool) -> None:
        self._rounds = rounds
        self._notify = notify
        self._observed = observed
        self._sessions: dict[str, Peer] = {}
        # The members of the current quorum already announced lost: (quorum id, ids).
        self._announced: tuple[int, set[str]] = (0, set())
        # Replicas the observer was told expired (so each expiry is told once).
        self._expired: set[str] = set()
        # Groups announced lost (not for a give-up): (quorum id, why), until they reopen a
        # session (``missed``). Bounded: the oldest go first.
        self._lost_from: dict[str, tuple[int, str]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, replica_id: str, peer: Peer, last_quorum: pb.Quorum | None = None) -> int:
        """A group opened its session; returns the latest quorum id (after adopting the
        ``last_quorum`` its Hello reported), for its Welcome."""
        self._sessions[replica_id] = peer
        self._rounds.restore(last_quorum, f"replica {replica_id}")
        rounds = self._rounds
        with rounds.lock:
            session_opened(rounds.state, replica_id, time.monotonic())
            quorum_id = rounds.state.quorum_id
        logger.info("Replica %s opened its session", replica_id)
        return quorum_id

    def missed(self, replica_id: str, last_quorum: pb.Quorum | None) -> bytes | None:
        """The serialized ``MemberLost`` about itself a group missed while it had no session,
        if it was lost from the quorum its Hello says it is still in (told once)."""
        lost = self._lost_from.pop(replica_id, None)
        if lost is None or last_quorum is None or last_quorum.quorum_id != lost[0]:
            return None
        quorum_id, reason = lost
        logger.info(
            "Replica %s is back in a session, still in quorum %d it was lost from (%s): telling it",
            replica_id,
            quorum_id,
            reason,
        )
        return spb.SessionEvent(
            lost=spb.MemberLost(replica_id=replica_id, quorum_id=quorum_id, reason=reason)
        ).SerializeToString()

    def end(self, replica_id: str, peer: Peer, reason: str, steps_done: int = 0) -> None:
        """A group's session ended: the group is gone now (unless a newer session replaced it).

        ``reason``: "connection ended", or "left..." for a goodbye; ``steps_done`` (from the
        goodbye, 0: not said) is passed on in the notice.
        """
        if self._sessions.get(replica_id) is not peer:
            return  # a newer session of the same group is live; this one was stale
        del self._sessions[replica_id]
        rounds = self._rounds
        with rounds.lock:
            was_member = session_ended(rounds.state, replica_id)
            prev = rounds.state.prev_quorum
        # A goodbye is news, not a warning; a connection that just ended is.
        level = logging.INFO if reason.startswith("left") else logging.WARNING
        logger.log(level, "Replica %s is gone: its session ended (%s)", replica_id, reason)
        if was_member and prev is not None:
            self._announce(
                replica_id, prev.quorum_id, reason, time.monotonic(), steps_done=steps_done
            )
        # The survivors may be complete without it now.
        rounds.schedule_tick()

    def on_tick(self) -> None:
        """Announce members lost to an expired heartbeat; tell the observer about expiries."""
        rounds = self._rounds
        now = time.monotonic()
        with rounds.lock:
            prev = rounds.state.prev_quorum
            lost = lost_members(rounds.state, rounds.config, now) if prev is not None else []
        if prev is not None:
            for replica_id in lost:
                self._announce(replica_id, prev.quorum_id, "heartbeat expired", now)
        if self._observed:
            self._report_expired(now)

    def on_issued(self, before: Quorum | None, issued: Quorum) -> None:
        """Tell each live member of ``before`` left out of ``issued`` that its quorum is over."""
        rounds = self._rounds
        with rounds.lock:
            left = left_out(rounds.state, before, issued)
        if not left or before is None:
            return
        announced_id, announced = self._announced
        for replica_id in left:
            peer = self._sessions.get(replica_id)
            if peer is None or (announced_id == before.quorum_id and replica_id in announced):
                continue  # (already told, with everyone, that it was lost from that quorum)
            reason = f"not in quorum {issued.quorum_id}: it had not asked for it in time"
            logger.warning(
                "Replica %s of quorum %d is alive but was left out of quorum %d (it had not "
                "asked for it within the wait for late members); telling it",
                replica_id,
                before.quorum_id,
                issued.quorum_id,
            )
            peer.send(
                spb.SessionEvent(
                    lost=spb.MemberLost(
                        replica_id=replica_id,
                        quorum_id=before.quorum_id,
                        reason=reason,
                        superseded_by=issued.quorum_id,
                    )
                ).SerializeToString()
            )

    def gave_up(self, replica_id: str, peer: Peer, quorum_id: int, reason: str) -> None:
        """A group gave up building quorum ``quorum_id``'s process group: every member, itself
        included, is told as if it were lost, so nobody waits for a timeout there. Only for the
        latest quorum, from the group's live session; anything else is stale."""
        if self._sessions.get(replica_id) is not peer:
            return  # a stale session of the group
        with self._rounds.lock:
            prev = self._rounds.state.prev_quorum
        if prev is None or prev.quorum_id != quorum_id:
            logger.info(
                "Replica %s gave up building quorum %d, which is not the latest: ignored",
                replica_id,
                quorum_id,
            )
            return
        if all(m.replica_id != replica_id for m in prev.participants):
            return
        self._announce(
            replica_id, quorum_id, f"{GAVE_UP_REASON}: {reason}", time.monotonic(), gave_up=True
        )

    def _announce(
        self,
        replica_id: str,
        quorum_id: int,
        reason: str,
        now: float,
        *,
        gave_up: bool = False,
        steps_done: int = 0,
    ) -> None:
        announced_id, announced = self._announced
        if announced_id != quorum_id:
            announced = set()
            self._announced = (quorum_id, announced)
        if replica_id in announced:
            return
        announced.add(replica_id)
        if not gave_up:
            self._lost_from.pop(replica_id, None)
            self._lost_from[replica_id] = (quorum_id, reason)
            while len(self._lost_from) > _REMEMBERED_LOST:
                del self._lost_from[next(iter(self._lost_from))]
        logger.log(
            logging.INFO if reason.startswith("left") else logging.WARNING,
            "Replica %s of quorum %d is lost (%s); telling %d session(s)",
            replica_id,
            quorum_id,
            reason,
            len(self._sessions),
        )
        event = spb.SessionEvent(
            lost=spb.MemberLost(
                replica_id=replica_id,
                quorum_id=quorum_id,
                reason=reason,
                gave_up=gave_up,
                steps_done=steps_done,
            )
        ).SerializeToString()
        for peer in list(self._sessions.values()):
            peer.send(event)
        if self._observed:
            self._notify("lost", replica_id, reason, now)

    def _report_expired(self, now: float) -> None:
        rounds = self._rounds
        timeout_s = rounds.config.heartbeat_timeout_ms / 1000.0
        with rounds.lock:
            heartbeats = rounds.state.heartbeats
            for rid, seen in heartbeats.items():
                if now - seen < timeout_s:
                    self._expired.discard(rid)  # alive (again)
                elif rid not in self._expired:
                    self._expired.add(rid)
                    self._notify("expired", rid, seen, now)
            if self._expired:
                self._expired.intersection_update(heartbeats)  # drop forgotten replicas
