"""Each replica group's divergence-guard report, and where its mismatches rose (pure).

A group's rank 0 sends its guard's counts with every quorum request (``guard_report.py``), and
the lighthouse echoes them in the issued quorum. :class:`GuardReports` keeps each group's last
report (by name, across restarts), and a mark wherever a group's mismatch count rose: the
quorum's time, the group and its step, drawn red on the page's timeline. A restarted group
counts from zero again, so a rise is measured against the same replica id's last report (a new
id's whole count is new).
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
    """The groups' last guard reports and the mismatch marks, folded from issued quorums.

    Args:
        marks: how many mismatch marks are kept (the oldest go first).
    """

    def __init__(self, marks: int = 200) -> None:
        self._last: dict[str, _Last] = {}
        self._marks: deque[dict[str, Any]] = deque(maxlen=marks)

    def quorum(self, t: float, members: Iterable[MemberInfo]) -> None:
        """Take in the reports of an issued quorum's members.

        Args:
            t: wall-clock seconds of the quorum.
            members: its members; those without a report change nothing.
        """
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
