"""A replica group's request to the lighthouse for one quorum round, retried as the policy says.

Once every rank of the group has joined a round (``round.QuorumRound``), the manager server asks
the lighthouse once on the group's behalf, through its link (a session, or the reference's
unary call). A failed attempt is retried as the pure ``round.RetryPolicy`` decides; when it gives
up, the round's ranks get the failure (``DEADLINE_EXCEEDED`` when the lighthouse timed out, else
``INTERNAL``), all at once.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from torchheal.coordination import convert
from torchheal.coordination.lighthouse_link import LighthouseLink, LinkError
from torchheal.coordination.round import GiveUp, RetryPolicy, RoundStart
from torchheal.coordination.rpc.errors import status_name
from torchheal.coordination.types import Quorum

__all__ = ["MAX_LIGHTHOUSE_CALL_S", "MIN_RETRY_SLEEP_S", "LighthouseFailed", "request_quorum"]

logger: logging.Logger = logging.getLogger("torchheal.coordination.manager_server.quorum")

# Minimum pause between lighthouse attempts (reference §5).
MIN_RETRY_SLEEP_S = 0.1
# Longest lighthouse call. A rank may send any grpc-timeout up to 99999999H (~11,000 years),
# but the gRPC client overflows past ~7e9 s and fails such a call at once; a year is forever.
MAX_LIGHTHOUSE_CALL_S = 365 * 24 * 3600.0


class LighthouseFailed(Exception):
    """The lighthouse call of a round failed for good; carries the status to give the ranks.

    Args:
        code: the status.
        details: what went wrong.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


async def request_quorum(
    link: LighthouseLink, start: RoundStart, retry: RetryPolicy, log_prefix: str
) -> Quorum:
    """The group's lighthouse request for the round ``start`` began.

    Args:
        link: the server's link to the lighthouse.
        start: the round: the member that speaks for the group, and its timeout.
        retry: when to try again.
        log_prefix: prefixes log lines (``[Replica name]``).

    Raises:
        LighthouseFailed: every attempt the policy allows failed.
    """
    requester = convert.member_to_pb(start.member)
    timeout_s = min(start.timeout_s, MAX_LIGHTHOUSE_CALL_S)
    attempt = 0
    while True:
        try:
            quorum = convert.quorum_from_pb(
                await link.quorum(requester, timeout_s), strict_data=False
            )
            logger.debug(
                "%s got quorum %d with %d participants",
                log_prefix,
                quorum.quorum_id,
                len(quorum.participants),
            )
            return quorum
        except LinkError as e:
            code = e.code
            got_status = not e.local
            timed_out = code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
            error = f"status: {status_name(code)}, message: {e.details!r}"
        logger.warning(
            "%s lighthouse quorum attempt %d/%d failed: %s",
            log_prefix,
            attempt + 1,
            retry.retries + 1,
            error,
        )
        decision = retry.after_failure(
            attempt, timeout_s, got_status=got_status, timed_out=timed_out, error=error
        )
        if isinstance(decision, GiveUp):
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if decision.timed_out
                else grpc.StatusCode.INTERNAL
            )
            raise LighthouseFailed(code, decision.message)
        attempt += 1
        await asyncio.sleep(decision.sleep_s)
