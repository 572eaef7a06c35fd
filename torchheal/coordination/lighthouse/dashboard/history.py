"""The job's history as the dashboard shows it, folded from lighthouse events (pure).

Within fixed bounds: who joined or left and why, each lost member's recovery timeline, steps/s
and quorum size over time. A group's commits between two quorums are ``step - max(its previous
step, the job's previous step)``, so a heal's jump to the job's step counts as nothing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torchheal.coordination.lighthouse.dashboard.events import (
    Event,
    Expired,
    Joined,
    KillRequested,
    Lost,
    MemberInfo,
    QuorumIssued,
    ReasonChanged,
    group_name,
)
from torchheal.coordination.lighthouse.dashboard.verified import GuardReports

__all__ = ["History", "HistoryLimits"]

CAUSE_KILLED = "killed from dashboard"
CAUSE_EXPIRED = "heartbeat expired"
CAUSE_ABSENT = "did not ask to join"


@dataclass(frozen=True)
class HistoryLimits:
    """Bounds on what a :class:`History` keeps (``rate_window_s``: of "steps/s now")."""

    bucket_s: float = 1.0
    buckets: int = 3600
    changes: int = 500
    failures: int = 200
    divergences: int = 200
    rate_window_s: float = 10.0


@dataclass
class _Bucket:
    start: float
    job: int = 0  # job steps committed
    groups: dict[str, int] = field(default_factory=dict)  # group -> commits (members only)
    size: int = 0  # quorum size at the bucket's end


@dataclass
class _Track:
    """What is known about one replica group (by name), across restarts."""

    replica_id: str
    step: int
    job_step: int  # the job's step in the quorum where ``step`` was seen


@dataclass
class _Failure:
    group: str
    replica_id: str
    cause: str
    last_in_quorum: float  # the last quorum that still had it
    noticed: float
    went_on: float | None = None  # first quorum without it
    returned: float | None = None  # the group asked to join again
    rejoined: float | None = None  # the group is in a quorum again
    healed: float | None = None  # ...and at the job's step
    lost_s: float | None = None  # job time lost to the stall


class History:
    """Folds lighthouse events into the quorum history, recovery timeline and charts."""

    def __init__(self, limits: HistoryLimits | None = None) -> None:
        self.limits = limits or HistoryLimits()
        self._current: QuorumIssued | None = None
        self._job_step: int | None = None
        self._tracks: dict[str, _Track] = {}
        self._changes: deque[dict[str, Any]] = deque(maxlen=self.limits.changes)
        self._failures: deque[_Failure] = deque(maxlen=self.limits.failures)
        # The few records every quorum must look at: failures not gone on from yet (by replica
        # id), and those whose group has not healed yet.
        self._open: dict[str, _Failure] = {}
        self._recovering: list[_Failure] = []
        self._buckets: deque[_Bucket] = deque(maxlen=self.limits.buckets)
        self._intervals: deque[float] = deque(maxlen=32)  # recent gaps between quorums
        self._notices: dict[str, tuple[float, str]] = {}  # replica_id -> (when, cause)
        self._reason = ""
        self._reason_since: float | None = None
        self._guard = GuardReports(self.limits.divergences)
        self.rounds = 0

    # ------------------------------------------------------------------------------------------
    # Events

    def apply(self, event: Event) -> None:
        """Fold one event in; events must come in the order they happened."""
        if isinstance(event, QuorumIssued):
            self._quorum(event)
        elif isinstance(event, Expired):
            self._notice(event.t, event.replica_id, CAUSE_EXPIRED)
        elif isinstance(event, Lost):
            if event.reason.startswith("left"):
                # A goodbye: the cause, should the next quorum lack it, not a failure itself.
                self._notices.setdefault(event.replica_id, (event.t, event.reason))
            else:
                self._notice(event.t, event.replica_id, event.reason)
        elif isinstance(event, KillRequested):
            self._killed(event)
        elif isinstance(event, Joined):
            self._joined(event)
        elif isinstance(event, ReasonChanged):
            if event.reason != self._reason:
                self._reason, self._reason_since = event.reason, event.t
        else:
            raise TypeError(f"not a dashboard event: {event!r}")

    def _notice(self, t: float, replica_id: str, cause: str) -> None:
        # The first notice wins: a kill is followed by the heartbeat expiring.
        self._notices.setdefault(replica_id, (t, cause))
        if len(self._notices) > 4 * self.limits.failures:
            self._notices.pop(next(iter(self._notices)))
        current = self._current
        if current is None or replica_id not in {m.replica_id for m in current.members}:
            return
        if replica_id not in self._open:
            self._add(_Failure(group_name(replica_id), replica_id, cause, current.t, noticed=t))

    def _killed(self, event: KillRequested) -> None:
        # The kill is the cause even when the session end was seen first (the manager exits as
        # soon as it answers, which can be before the kill is recorded).
        rid = event.replica_id
        earlier = self._notices.get(rid)
        self._notices[rid] = (earlier[0] if earlier else event.t, CAUSE_KILLED)
        failure = self._open.get(rid) or next(
            (f for f in self._recovering if f.replica_id == rid), None
        )
        if failure is not None:
            failure.cause = CAUSE_KILLED
        else:
            self._notice(event.t, rid, CAUSE_KILLED)

    def _add(self, failure: _Failure) -> None:
        self._failures.append(failure)
        self._open[failure.replica_id] = failure

    def _joined(self, event: Joined) -> None:
        group = group_name(event.replica_id)
        for failure in [*self._open.values(), *self._recovering]:
            if failure.group == group and failure.returned is None:
                if failure.replica_id != event.replica_id or failure.went_on is not None:
                    failure.returned = event.t

    def _quorum(self, q: QuorumIssued) -> None:
        prev = self._current
        job_step = max((m.step for m in q.members), default=0)
        self.rounds += 1

        bucket = self._bucket(q.t)
        if self._job_step is not None:
            bucket.job += max(0, job_step - self._job_step)
        self._job_step = job_step
        bucket.size = len(q.members)
        for m in q.members:
            group = group_name(m.replica_id)
            track = self._tracks.get(group)
            commits = 0
            if track is not None and track.replica_id == m.replica_id:
                commits = max(0, m.step - max(track.step, track.job_step))
            bucket.groups[group] = bucket.groups.get(group, 0) + commits
            self._tracks[group] = _Track(m.replica_id, m.step, job_step)

        prev_ids = {m.replica_id for m in prev.members} if prev else set()
        new_ids = {m.replica_id for m in q.members}
        for rid, failure in self._open.items():
            if rid in new_ids:
                failure.last_in_quorum = q.t  # noticed, but still took part in this round
        left = [self._left(rid, prev, q) for rid in sorted(prev_ids - new_ids)] if prev else []
        joined = [self._rejoined(m, q, job_step) for m in q.members if m.replica_id not in prev_ids]
        if self._recovering:
            self._mark_healed(q, job_step)
        self._guard.quorum(q.t, q.members)
        if prev is not None:
            self._intervals.append(q.t - prev.t)

        if prev is None or left or joined or q.quorum_id != prev.quorum_id:
            failing = [
                {"replica_id": m.replica_id, "commit_failures": m.commit_failures}
                for m in q.members
                if m.commit_failures > 0
            ]
            self._changes.append(
                {
                    "t": q.t,
                    "quorum_id": q.quorum_id,
                    "size": len(q.members),
                    "joined": joined,
                    "left": left,
                    "commit_failures": failing,
                    "reason": q.reason,
                    "round_s": q.round_s,
                }
            )
        self._current = q

    def _left(self, replica_id: str, prev: QuorumIssued, q: QuorumIssued) -> dict[str, Any]:
        notice = self._notices.pop(replica_id, None)
        failure = self._open.pop(replica_id, None)
        if failure is None:
            noticed, cause = notice if notice else (q.t, CAUSE_ABSENT)
            failure = _Failure(group_name(replica_id), replica_id, cause, prev.t, noticed=noticed)
            self._failures.append(failure)
        failure.went_on = q.t
        failure.lost_s = max(0.0, q.t - failure.last_in_quorum - self._typical_interval())
        self._recovering.append(failure)
        return {"replica_id": replica_id, "group": failure.group, "why": failure.cause}

    def _rejoined(self, m: MemberInfo, q: QuorumIssued, job_step: int) -> dict[str, Any]:
        group = group_name(m.replica_id)
        behind = m.step < job_step
        why = "new replica group"
        for failure in self._recovering:
            if failure.group == group and failure.rejoined is None:
                failure.rejoined = q.t
                if failure.returned is None:
                    failure.returned = q.t
                why = "restarted" if failure.replica_id != m.replica_id else "returned"
        if behind:
            why += f", healing from step {m.step} to {job_step}"
        return {"replica_id": m.replica_id, "group": group, "why": why}

    def _mark_healed(self, q: QuorumIssued, job_step: int) -> None:
        in_sync = {group_name(m.replica_id) for m in q.members if m.step >= job_step}
        for failure in self._recovering:
            if failure.rejoined is not None and failure.group in in_sync:
                failure.healed = q.t
        self._recovering = [f for f in self._recovering if f.healed is None]
        # Bounded like the records: a group that never comes back stops being watched.
        del self._recovering[: -self.limits.failures]

    def _typical_interval(self) -> float:
        # The usual time between quorums (one step) is not lost time; the median ignores the
        # stall being measured and the odd slow step.
        return statistics.median(self._intervals) if self._intervals else 0.0

    def _bucket(self, t: float) -> _Bucket:
        width = self.limits.bucket_s
        start = math.floor(t / width) * width
        buckets = self._buckets
        if buckets and start <= buckets[-1].start:
            return buckets[-1]  # late or same-bucket events land in the newest bucket
        size = buckets[-1].size if buckets else 0
        if buckets:
            # Fill a gap (a stall: no quorum issued) with empty buckets, at most a window's worth.
            gap = min(round((start - buckets[-1].start) / width) - 1, self.limits.buckets)
            first = start - gap * width
            for i in range(gap):
                buckets.append(_Bucket(first + i * width, size=size))
        buckets.append(_Bucket(start, size=size))
        return buckets[-1]

    # ------------------------------------------------------------------------------------------
    # Views

    @property
    def current(self) -> QuorumIssued | None:
        """The last issued quorum, if any."""
        return self._current

    def view(self, now: float) -> dict[str, Any]:
        """What the page shows besides the charts, as JSON-able data (``now``: wall clock);
        lists are newest first."""
        rates = self._rates(now)
        guard = self._guard.view()
        members = []
        current = self._current
        if current is not None:
            job_step = self._job_step or 0
            for m in current.members:
                group = group_name(m.replica_id)
                members.append(
                    {
                        "replica_id": m.replica_id,
                        "group": group,
                        "step": m.step,
                        "address": m.address,
                        "commit_failures": m.commit_failures,
                        "world_size": m.world_size,
                        "healing": m.step < job_step,
                        "rate": rates["groups"].get(group),
                    }
                )
        return {
            "quorum_id": current.quorum_id if current else None,
            "quorum_t": current.t if current else None,
            "members": members,
            "job_step": self._job_step,
            "job_rate": rates["job"],
            "reason": self._reason,
            "reason_since": self._reason_since,
            "rounds": self.rounds,
            "changes": list(reversed(self._changes)),
            "failures": [_failure_view(f, now) for f in reversed(self._failures)],
            "guard": guard["groups"],
            "divergences": guard["marks"],
        }

    def _rates(self, now: float) -> dict[str, Any]:
        width = self.limits.bucket_s
        wanted = max(1, round(self.limits.rate_window_s / width))
        done: list[_Bucket] = []
        for b in reversed(self._buckets):
            if len(done) == wanted or b.start + width <= now - self.limits.rate_window_s:
                break
            if b.start + width <= now:
                done.append(b)
        if not done:
            return {"job": None, "groups": {}}
        commits: dict[str, int] = {}
        present: dict[str, int] = {}  # buckets in which the group was a member
        for b in done:
            for g, n in b.groups.items():
                commits[g] = commits.get(g, 0) + n
                present[g] = present.get(g, 0) + 1
        return {
            "job": sum(b.job for b in done) / (len(done) * width),
            "groups": {g: n / (present[g] * width) for g, n in commits.items()},
        }

    def _complete(self, now: float) -> list[_Bucket]:
        # The newest bucket is still filling until its end; showing it would dip every chart.
        width = self.limits.bucket_s
        return [b for b in self._buckets if b.start + width <= now]

    def series(self, now: float, since: float | None = None) -> dict[str, Any]:
        """Chart data, column-wise, for the complete buckets starting after ``since`` (None:
        all); ``groups`` maps group -> steps/s (None while not a member)."""
        width = self.limits.bucket_s
        buckets = [b for b in self._complete(now) if since is None or b.start > since]
        names = sorted({g for b in buckets for g in b.groups})
        return {
            "bucket_s": width,
            "t": [b.start for b in buckets],
            "job": [b.job / width for b in buckets],
            "groups": {
                g: [b.groups[g] / width if g in b.groups else None for b in buckets] for g in names
            },
            "quorum_size": [b.size for b in buckets],
        }


def _failure_view(f: _Failure, now: float) -> dict[str, Any]:
    if f.healed is not None:
        state = "healed"
    elif f.rejoined is not None:
        state = "healing"
    elif f.returned is not None:
        state = "returning"
    elif f.went_on is not None:
        state = "down"
    else:
        state = "noticed"
    end = f.healed if f.healed is not None else now
    return {
        "group": f.group,
        "replica_id": f.replica_id,
        "cause": f.cause,
        "state": state,
        "last_in_quorum": f.last_in_quorum,
        "noticed": f.noticed,
        "went_on": f.went_on,
        "returned": f.returned,
        "rejoined": f.rejoined,
        "healed": f.healed,
        "lost_s": f.lost_s,
        "down_s": max(0.0, end - f.noticed),
    }
