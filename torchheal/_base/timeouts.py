"""Timeouts as float seconds: the one conversion every layer uses.

The public API takes ``datetime.timedelta`` (as the reference does); sockets, locks, pipes and
event loops want seconds. Converting in one place means one rule for what a timeout may be.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["to_seconds"]


def to_seconds(timeout: timedelta | float | int) -> float:
    """Returns ``timeout`` (a ``timedelta`` or a number of seconds, not a bool) as float seconds.

    Raises ``TypeError`` for any other type, ``ValueError`` when negative.
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a timedelta, got {type(timeout).__name__}")
    if seconds < 0:
        raise ValueError(f"timeout must not be negative, got {timeout!r}")
    return seconds
