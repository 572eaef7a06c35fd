"""A replica group's request to the lighthouse for one quorum round, retried as the policy says.

A failed attempt is retried as ``round.RetryPolicy`` decides; when it gives up, the round's
ranks all get the failure (``DEADLINE_EXCEEDED`` when the lighthouse timed out, else
``INTERNAL``). A lighthouse that cannot be reached decided nothing, so the request is sent again
every :data:`UNAVAILABLE_RETRY_S` until the round's timeout is spent, whatever ``quorum_retries``
says: a restarted lighthouse costs a pause, not every group's life (unlike the reference).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from torchheal.coordination import convert
from torchheal.coordination.group.dial import LinkError
from torchheal.coordination.group.link import LighthouseLink
from torchheal.coordination.round import GiveUp, RetryPolicy, RoundStart
from torchheal.coordination.rpc.errors import status_name
from torchheal.coordination.types import Quorum

__all__ = [
    "MAX_LIGHTHOUSE_CALL_S",
    "MIN_RETRY_SLEEP_S",
    "UNAVAILABLE_RETRY_S",
    "LighthouseFailed",
    "is_unreachable",
    "request_quorum",
]

logger: logging.Logger = logging.getLogger("torchheal.coordination.group.quorum")

# Minimum pause between lighthouse attempts (reference §5).
MIN_RETRY_SLEEP_S = 0.1
# Longest lighthouse call: the gRPC client overflows past ~7e9 s; a year is forever.
MAX_LIGHTHOUSE_CALL_S = 365 * 24 * 3600.0
# Pause between requests while the lighthouse cannot be reached (the session reopens with a
# backoff of its own; this bounds how late the request follows it).
UNAVAILABLE_RETRY_S = 0.1


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


# What gRPC core (and our link) says when nobody answered at all. A lighthouse that answers with
# a status of its own (even UNAVAILABLE) made a decision: the retry policy counts it.
_UNREACHABLE_DETAILS = (
    "the lighthouse session",  # link.py: reopening, or broke under the request
    "failed to connect",
    "connection refused",
    "connection reset",
    "socket closed",
    "broken pipe",
    "connections to all backends failing",
    "goaway",
    "keepalive",
    "end of tcp stream",
)


def is_unreachable(error: LinkError) -> bool:
    """Whether ``error`` means the lighthouse could not be reached (rather than refused)."""
    if error.code != grpc.StatusCode.UNAVAILABLE:
        return False
    details = error.details.lower()
    return any(phrase in details for phrase in _UNREACHABLE_DETAILS)


async def request_quorum(
    link: LighthouseLink, start: RoundStart, retry: RetryPolicy, log_prefix: str
) -> Quorum:
    """The group's lighthouse request for the round ``start`` began (:class:`LighthouseFailed`
    once every attempt the policy allows failed)."""
    requester = convert.member_to_pb(start.member)
    timeout_s = min(start.timeout_s, MAX_LIGHTHOUSE_CALL_S)
    deadline = time.monotonic() + timeout_s
    attempt = 0
    unreachable_since: float | None = None
    while True:
        # After an outage the ranks have only what is left of their timeout to wait.
        attempt_s = (
            timeout_s if unreachable_since is None else max(0.001, deadline - time.monotonic())
        )
        try:
            quorum = convert.quorum_from_pb(
                await link.quorum(requester, attempt_s), strict_data=False
            )
            if unreachable_since is not None:
                logger.info(
                    "%s the lighthouse answers again after %.1fs unreachable",
                    log_prefix,
                    time.monotonic() - unreachable_since,
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
            unreachable = is_unreachable(e)
        if unreachable:
            left_s = deadline - time.monotonic()
            if unreachable_since is None:
                unreachable_since = time.monotonic()
                logger.warning(
                    "%s the lighthouse cannot be reached (%s); asking again every %.1fs for "
                    "up to %.1fs",
                    log_prefix,
                    error,
                    UNAVAILABLE_RETRY_S,
                    max(0.0, left_s),
                )
            if left_s > UNAVAILABLE_RETRY_S:
                await asyncio.sleep(UNAVAILABLE_RETRY_S)
                continue
            raise LighthouseFailed(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"lighthouse quorum failed: the lighthouse could not be reached for "
                f"{time.monotonic() - unreachable_since:.1f}s (the round's timeout). last error: "
                f"{error}",
            )
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
