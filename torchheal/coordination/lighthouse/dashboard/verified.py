"""Each replica group's divergence-guard report, and where its mismatches rose (pure).

Groups send their guard's counts with each quorum request and the lighthouse echoes them in the
issued quorum. A restarted group counts from zero again, so a rise is measured against the same
replica id's last report (a new id's whole count is new).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torchheal.coordination.guard_report import GuardReport
from torchheal.coordination.lighthouse.dashboard.events import MemberInfo, group_name

__all__ = ["GuardReports"]


@dataclass(frozen=True)
class _Last:
    replica_id: str
    report: GuardReport
    t: float


class GuardReports:
    """The groups' last guard reports (by name) and the last ``marks`` mismatch rises."""

    def __init__(self, marks: int = 200) -> None:
        self._last: dict[str, _Last] = {}
        self._marks: deque[dict[str, Any]] = deque(maxlen=marks)

    def quorum(self, t: float, members: Iterable[MemberInfo]) -> None:
        """Take in the reports of the members of a quorum issued at ``t`` (wall clock)."""
        for m in members:
            report = m.guard
            if report is None:
                continue
            group = group_name(m.replica_id)
            last = self._last.get(group)
            before = last.report.mismatches if last and last.replica_id == m.replica_id else 0
            if report.mismatches > before:
                self._marks.append(
                    {
                        "t": t,
                        "group": group,
                        "replica_id": m.replica_id,
                        "step": m.step,
                        "mismatches": report.mismatches,
                        "new": report.mismatches - before,
                    }
                )
            self._last[group] = _Last(m.replica_id, report, t)

    def view(self) -> dict[str, Any]:
        """``groups`` (name -> ``replica_id``, ``verified`` (-1: not yet), ``checks``,
        ``mismatches``, ``t`` of the report) and ``marks`` (mismatch rises, newest first)."""
        return {
            "groups": {
                group: {
                    "replica_id": last.replica_id,
                    "verified": last.report.verified,
                    "checks": last.report.checks,
                    "mismatches": last.report.mismatches,
                    "t": last.t,
                }
                for group, last in sorted(self._last.items())
            },
            "marks": list(reversed(self._marks)),
        }
