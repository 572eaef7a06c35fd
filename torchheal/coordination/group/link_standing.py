"""What the link saw of the group's standing with the lighthouse, and the history it holds.

``standing.py`` judges whether the lighthouse may have dropped the group; the link feeds it its
ticks, requests, answers and the lighthouse's own word.
"""

from __future__ import annotations

import asyncio
import logging
import time

from torchheal._wire import session_pb2 as spb

__all__ = ["StandingWatch"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.link")


class StandingWatch:
    """The standing half of :class:`~torchheal.coordination.group.link.LighthouseLink` (a mixin:
    its state is set by the link's constructor)."""

    def holds_last_quorum(self, steps_done: int = 0) -> None:
        """The group holds the history of the last quorum it received: it committed a step in
        it (``steps_done``: the steps committed then), or healed in it from a peer that holds
        it (any thread: plain assignments, read by the loop when it next sends)."""
        self._session.holds_last_quorum(steps_done)

    def doubt(self) -> str | None:
        """Why the lighthouse may have dropped this group since its last quorum request, or
        None (``standing.Standing.doubt``). Any thread."""
        with self._standing_lock:
            return self._standing.doubt(time.monotonic())

    async def _tick(self) -> None:
        """Tick the standing every interval, lighthouse reachable or not: an outage of the
        lighthouse is not a stall of this group."""
        while True:
            with self._standing_lock:
                gap = self._standing.tick(time.monotonic())
            if gap is not None:
                logger.warning(
                    "%s this process was stalled for %.2fs (its heartbeats with it); the "
                    "lighthouse may have dropped this group, so a step in flight will not commit",
                    self._prefix,
                    gap,
                )
            await asyncio.sleep(self._interval_s)

    def _dropped(self, lost: spb.MemberLost) -> None:
        """The lighthouse says this group is lost (its heartbeat expired while it was frozen),
        or was left out of a newer quorum (``superseded_by``) while it had not asked."""
        last = self._session.last_quorum
        if last is not None and lost.quorum_id < last.quorum_id:
            return  # about a quorum before the one we now train in
        if lost.superseded_by:
            # Only its build is abandoned: doubting the vote would make slow start-ups heal.
            logger.info(
                "%s the lighthouse issued quorum %d without this group, still in quorum %d",
                self._prefix,
                lost.superseded_by,
                lost.quorum_id,
            )
            return
        if lost.gave_up:
            return  # a rank of ours gave that build up: it votes no, the step cannot commit
        logger.warning(
            "%s the lighthouse dropped this group from quorum %d (%s)",
            self._prefix,
            lost.quorum_id,
            lost.reason,
        )
        with self._standing_lock:
            doubted = self._standing.lost(lost.quorum_id, lost.reason)
        if not doubted:
            logger.info(
                "%s (the notice crossed this group's request for a newer quorum: its vote on the "
                "step of quorum %d was cast before it)",
                self._prefix,
                lost.quorum_id,
            )
