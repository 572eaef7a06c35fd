"""Progress events that demo workers print and the launcher reads.

Each event is one stdout line: ``@torchheal `` and a JSON object. A malformed event line is
ignored rather than trusted; other lines pass through untouched.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

MARKER = "@torchheal "


@dataclass(frozen=True)
class Event:
    """One progress report from a replica group (``kind``: "start", "step", "quorum", "heal",
    "done" or "error"; ``time``: the worker's wall clock; ``fields``: the rest)."""

    kind: str
    group: int
    time: float
    fields: dict[str, Any]


def emit(kind: str, group: int, **fields: Any) -> None:
    """Print one event line and flush, so the launcher sees it at once."""
    record = {"kind": kind, "group": group, "time": time.time(), **fields}
    sys.stdout.write(MARKER + json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def parse(line: str) -> Event | None:
    """Return the event on ``line``, or None when the line is not a well-formed event."""
    if not line.startswith(MARKER):
        return None
    try:
        record = json.loads(line[len(MARKER) :])
        kind = record.pop("kind")
        group = int(record.pop("group"))
        when = float(record.pop("time"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(kind, str):
        return None
    return Event(kind=kind, group=group, time=when, fields=record)
