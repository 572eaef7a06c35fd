"""A replica group's divergence-guard report, as it rides in its quorum requests (pure).

Group rank 0's Manager puts its guard's counts in ``QuorumMember.data`` (opaque JSON the
lighthouse echoes) for the dashboard and ``torchheal status``. ``data`` may be anyone's, so
:func:`from_data` takes only plausible integers under the three keys and never raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GuardReport", "from_data"]

# Short keys: the report travels in every quorum request of the job.
VERIFIED = "verified"
CHECKS = "checks"
MISMATCHES = "mismatches"
# Larger values are not counts a job can reach; a report carrying one is someone else's data.
_MAX_COUNT = 2**62


@dataclass(frozen=True)
class GuardReport:
    """What a group's divergence guard has seen so far.

    Args:
        verified: the last step whose comparison matched (-1: none yet).
        checks: comparisons whose verdict was taken.
        mismatches: those of them that found groups holding different state.
    """

    verified: int
    checks: int
    mismatches: int

    def to_data(self) -> dict[str, int]:
        """The report as the JSON object a quorum request carries."""
        return {VERIFIED: self.verified, CHECKS: self.checks, MISMATCHES: self.mismatches}


def _count(value: Any, lowest: int) -> int | None:
    # bool is an int in Python but never a count here.
    if type(value) is not int or not lowest <= value < _MAX_COUNT:
        return None
    return value


def from_data(data: Any) -> GuardReport | None:
    """The guard report in a member's ``data``; None for missing, foreign or malformed data."""
    if not isinstance(data, dict):
        return None
    verified = _count(data.get(VERIFIED), -1)
    checks = _count(data.get(CHECKS), 0)
    mismatches = _count(data.get(MISMATCHES), 0)
    if verified is None or checks is None or mismatches is None or mismatches > checks:
        return None
    return GuardReport(verified, checks, mismatches)
