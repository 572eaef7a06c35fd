"""What the launcher tells its user while a job runs and when it ends, read from the lighthouse.

The launcher does not know what a training script prints, but the dashboard's status document
(``GET /api/status``, ``docs/dashboard.md``) knows every group's step. From it, all pure:
:class:`FirstSteps` (which starts committed a first step), :func:`progress_line` and
:func:`render_report`. :class:`LiveLine` keeps the progress line below the groups' output.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = [
    "FirstSteps",
    "GroupReport",
    "LiveLine",
    "fetch_status",
    "progress_line",
    "quorum_members",
    "render_report",
]


def fetch_status(url: str, timeout: float = 2.0) -> Callable[[], dict[str, Any] | None]:
    """A function that reads the status document of the dashboard at base ``url`` (None when
    it cannot be read)."""
    endpoint = url.rstrip("/") + "/api/status"

    def read() -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(endpoint, timeout=timeout) as answer:
                doc = json.loads(answer.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return doc if isinstance(doc, dict) else None

    return read


def quorum_members(doc: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(store address, step)`` of each member of the current quorum, from the dashboard's
    status document or ``LighthouseServer.status()``."""
    quorum = doc.get("quorum")
    if isinstance(quorum, Mapping):
        members = quorum.get("members") or []
    else:
        members = (doc.get("prev_quorum") or {}).get("participants") or []
    found = []
    for m in members:
        if isinstance(m, Mapping) and isinstance(m.get("step"), int):
            found.append((str(m.get("store_address", "")), m["step"]))
    return found


class FirstSteps:
    """Learns which group starts have committed a step, from the quorums they are seen in.

    A start is first seen at the step it joined with (0, or its old step before it heals); a
    later quorum showing it higher means it committed. Starts are told apart by their store
    address, which the launcher makes unique per start.
    """

    def __init__(self) -> None:
        self._first: dict[str, int] = {}
        self._stepped: set[str] = set()

    def observe(self, members: Iterable[tuple[str, int]]) -> None:
        """Take in one quorum's ``(store address, step)`` pairs (:func:`quorum_members`)."""
        for address, step in members:
            first = self._first.setdefault(address, step)
            if step > first:
                self._stepped.add(address)

    def stepped(self, store_address: str) -> bool:
        """Whether the start with this store address has committed a step."""
        return store_address in self._stepped

    def forget(self, store_address: str) -> None:
        """Drop what is known about an ended start (keeps the maps bounded)."""
        self._first.pop(store_address, None)
        self._stepped.discard(store_address)


@dataclass(frozen=True)
class GroupReport:
    """What the launcher itself saw of one replica group.

    Args:
        group: the group index.
        starts: how many times it was started.
        kills: failures injected into it.
        crashes: times it died on its own.
        done: it finished its work.
        stopped: it died after another group had finished, and was not restarted.
    """

    group: int
    starts: int
    kills: int
    crashes: int
    done: bool
    stopped: bool = False


def _rate(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "-"


def progress_line(
    doc: Mapping[str, Any] | None, elapsed_s: float, groups: int, restarts: int
) -> str:
    """The line shown while the job runs (``doc`` None: the lighthouse could not be read)."""
    head = f"[launch {elapsed_s:6.1f}s]"
    if doc is None:
        return f"{head} waiting for the lighthouse's status"
    quorum = doc.get("quorum") or {}
    job = doc.get("job") or {}
    step = job.get("step")
    failures = doc.get("failures") or []
    healed = sum(1 for f in failures if f.get("state") == "healed")
    if quorum.get("id") in (None, 0) and step is None:
        return f"{head} waiting for the first quorum ({doc.get('reason', '')})"
    return (
        f"{head} step {step if step is not None else '-'}  {_rate(job.get('rate'))} steps/s  "
        f"quorum {quorum.get('id')}: {quorum.get('size', 0)}/{groups} groups  "
        f"failures {len(failures)} (healed {healed})  restarts {restarts}"
    )


def _seconds(value: Any) -> str:
    return f"{value:.2f}s" if isinstance(value, int | float) else "n/a"


def render_report(
    doc: Mapping[str, Any] | None,
    groups: list[GroupReport],
    wall_s: float,
    error: str | None,
    finished: bool = False,
) -> str:
    """The closing report of a launch (``doc`` None: the lighthouse could not be read;
    ``finished``: the job's work is done, so groups that left at the end are not failures)."""
    lines = ["", "== torchheal launch summary =="]
    job = (doc or {}).get("job") or {}
    failures = [f for f in (doc or {}).get("failures") or [] if not (finished and _left_at_end(f))]
    step = job.get("step")
    lines.append(
        f"job step               {step if step is not None else 'n/a'} (at the last quorum)"
    )
    lines.append(f"failures seen          {len(failures)} (by the lighthouse)")
    for f in reversed(failures):  # the document lists the newest first
        lines.append(f"  {f.get('group')} ({f.get('cause')}): {_failure_story(f)}")
    lost = sum(f.get("lost_s") or 0.0 for f in failures)
    lines.append(f"seconds lost           {lost:.2f}s (survivors' stall beyond a normal step)")
    for g in groups:
        if g.done:
            state = "finished"
        elif g.stopped:
            state = "not restarted: the job had finished"
        else:
            state = "stopped"
        lines.append(
            f"  group {g.group}: started {g.starts}x, killed {g.kills}x, crashed {g.crashes}x, "
            f"{state}"
        )
    lines.append(f"wall time              {wall_s:.1f}s")
    if error:
        lines.append(f"gave up                {error.splitlines()[0]}")
    return "\n".join(lines)


def _left_at_end(f: Mapping[str, Any]) -> bool:
    """In a finished job, whether this "failure" was a group ending its work: nobody went on
    without it, or it said goodbye and never came back (a late starter trains on after the
    others finish, which reads as going on without them)."""
    if f.get("went_on") is None:
        return True
    said_goodbye = str(f.get("cause", "")).startswith("left")
    return said_goodbye and f.get("returned") is None and f.get("healed") is None


def _failure_story(f: Mapping[str, Any]) -> str:
    """How one failure went, from the recovery timeline's times."""
    last, went_on, healed = f.get("last_in_quorum"), f.get("went_on"), f.get("healed")
    parts = []
    if isinstance(went_on, int | float) and isinstance(last, int | float):
        parts.append(f"survivors went on after {went_on - last:.2f}s")
    if isinstance(healed, int | float) and isinstance(went_on, int | float):
        parts.append(f"group back and healed {healed - went_on:.2f}s later")
    else:
        parts.append(f"now {f.get('state', 'unknown')}")
    parts.append(f"job time lost {_seconds(f.get('lost_s'))}")
    return "; ".join(parts)


class LiveLine:
    """Prints output lines with a progress line kept below them.

    On a terminal the progress line is redrawn in place; elsewhere it is printed as an
    ordinary line at most every ``every_s`` seconds, so logs stay readable (``clock``: for
    tests).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream or sys.stdout
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._every_s = every_s
        self._clock = clock
        self._status = ""
        self._shown = False
        self._last_print: float | None = None

    def print(self, text: str) -> None:
        """Print one ordinary line (``text`` without its newline)."""
        if self._tty and self._shown:
            self._stream.write("\r\033[K")
        self._stream.write(text + "\n")
        if self._tty and self._status:
            self._stream.write(self._status)
            self._shown = True
        self._stream.flush()

    def status(self, text: str) -> None:
        """Show ``text`` as the progress line."""
        self._status = text
        if self._tty:
            self._stream.write("\r\033[K" + text)
            self._shown = True
            self._stream.flush()
            return
        now = self._clock()
        if self._last_print is None or now - self._last_print >= self._every_s:
            self._last_print = now
            self._stream.write(text + "\n")
            self._stream.flush()

    def close(self) -> None:
        """End the progress line (on a terminal, leave it on screen)."""
        if self._tty and self._shown:
            self._stream.write("\n")
            self._stream.flush()
        self._shown = False
        self._status = ""
