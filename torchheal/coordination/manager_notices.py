"""A manager server passing the lighthouse's ``MemberLost`` notices on to its group's ranks.

When another group of the current quorum is gone, the lighthouse tells every session; each
manager server forwards the notice to every rank of its own group, so each can abort the
collective it has in flight with the lost group at once. Ranks > 0 watch their server over gRPC
(``torchheal.ManagerNotices/Watch``, a stream of notices); group rank 0 lives in the server's
process and registers a listener. Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from torchheal._wire import session_pb2 as spb

__all__ = ["NoticeFanout", "listener_args"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.manager_server.notices")


def listener_args(lost: spb.MemberLost) -> tuple[str, int, str, bool, bool]:
    """What a lost-member listener is called with: ``(replica_id, quorum_id, reason, gave_up,
    superseded)``."""
    return lost.replica_id, lost.quorum_id, lost.reason, lost.gave_up, bool(lost.superseded_by)


class NoticeFanout:
    """Who hears a group's lost-member notices: watching ranks and in-process listeners.

    Args:
        replica_id: this group's full id (a notice about itself says it was dropped).
        log_prefix: prefixes log lines (``[Replica name]``).
    """

    def __init__(self, replica_id: str, log_prefix: str) -> None:
        self._replica_id = replica_id
        self._prefix = log_prefix
        self._watchers: set[asyncio.Queue[bytes]] = set()
        self._listeners: list[Callable[[str, int, str, bool, bool], None]] = []

    def add_listener(self, listener: Callable[[str, int, str, bool, bool], None]) -> None:
        """Also call ``listener(replica_id, quorum_id, reason, gave_up, superseded)`` for every
        notice (on the loop thread; ``gave_up``: the group gave that quorum's build up, it is
        not gone; ``superseded``: about this group, left out of a newer quorum while still at
        work in this one, not dropped)."""
        self._listeners.append(listener)

    def forward(self, lost: spb.MemberLost) -> None:
        """The lighthouse says a group of quorum ``lost.quorum_id`` is gone: tell every rank."""
        if lost.replica_id == self._replica_id and lost.gave_up:
            # A rank of ours gave that quorum's build up: every rank ends its build or group
            # for that quorum (the peers end theirs).
            logger.warning(
                "%s lighthouse: this group gave up building quorum %d (%s)",
                self._prefix,
                lost.quorum_id,
                lost.reason,
            )
        elif lost.replica_id == self._replica_id:
            # About ourselves: the lighthouse dropped this group (it was frozen past its
            # heartbeat timeout, or it issued a newer quorum without it while it was still at
            # work in this one); the link made a freeze a doubt of the vote (standing.py). The
            # ranks are told too: they abandon a build of that quorum (their peers abandoned
            # it) and, unless only superseded, abort a group built for it
            # (``ConnectedQuorum.on_dropped``).
            logger.warning(
                "%s lighthouse: this group was dropped from quorum %d (%s)",
                self._prefix,
                lost.quorum_id,
                lost.reason,
            )
        else:
            # A group that said goodbye finished its job (INFO, as the lighthouse logs it); one
            # that vanished is a failure (WARNING).
            logger.log(
                logging.INFO if lost.reason.startswith("left") else logging.WARNING,
                "%s lighthouse: replica %s of quorum %d is lost (%s)",
                self._prefix,
                lost.replica_id,
                lost.quorum_id,
                lost.reason,
            )
        notice = spb.Notice(lost=lost).SerializeToString()
        for queue in list(self._watchers):
            queue.put_nowait(notice)
        for listener in list(self._listeners):
            try:
                listener(*listener_args(lost))
            except Exception:
                logger.exception("%s a lost-member listener failed", self._prefix)

    async def watch(self) -> AsyncIterator[bytes]:
        """The serialized ``Notice`` messages for one watching rank, as they come."""
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._watchers.discard(queue)
