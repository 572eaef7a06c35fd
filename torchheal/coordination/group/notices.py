"""A manager server passing the lighthouse's ``MemberLost`` notices on to its group's ranks.

Each rank can then abort the collective it has in flight with a lost group at once. Ranks > 0
watch over gRPC (``torchheal.ManagerNotices/Watch``); group rank 0, in the server's process,
registers a listener. Runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from torchheal._wire import session_pb2 as spb
from torchheal.coordination import convert
from torchheal.coordination.types import Notice, NoticeKind

__all__ = ["NoticeFanout"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.notices")


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
        self._listeners: list[Callable[[Notice], None]] = []

    def add_listener(self, listener: Callable[[Notice], None]) -> None:
        """Also call ``listener(notice)`` for every notice (on the loop thread), decoded as this
        group hears it (``convert.notice_from_pb``)."""
        self._listeners.append(listener)

    def forward(self, lost: spb.MemberLost) -> None:
        """The lighthouse says a group of quorum ``lost.quorum_id`` is gone: tell every rank."""
        notice = convert.notice_from_pb(lost, self._replica_id)
        if notice.kind is NoticeKind.GAVE_UP:
            # A rank of ours gave that quorum's build up: every rank ends its build or group.
            logger.warning(
                "%s lighthouse: this group gave up building quorum %d (%s)",
                self._prefix,
                notice.quorum_id,
                notice.reason,
            )
        elif notice.kind is not NoticeKind.LOST:
            # We were dropped (the link already doubts the vote); the ranks abandon that quorum's
            # build and, unless only superseded, its group (``machine.Connection.on_notice``).
            logger.warning(
                "%s lighthouse: this group was dropped from quorum %d (%s)",
                self._prefix,
                notice.quorum_id,
                notice.reason,
            )
        else:
            # A group that said goodbye finished its job; one that vanished is a failure.
            logger.log(
                logging.INFO if notice.reason.startswith("left") else logging.WARNING,
                "%s lighthouse: replica %s of quorum %d is lost (%s)",
                self._prefix,
                notice.replica_id,
                notice.quorum_id,
                notice.reason,
            )
        wire = spb.Notice(lost=lost).SerializeToString()
        for queue in list(self._watchers):
            queue.put_nowait(wire)
        for listener in list(self._listeners):
            try:
                listener(notice)
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
