"""Phase marks of a heal, on both sides, for benchmarks and debugging.

A rejoin crosses many parts (quorum, process-group rebuild, snapshot, staging, transfer,
verification, load); :func:`mark` names the moment one phase begins or ends, on the logger
``torchheal.timeline`` at DEBUG. Nothing is formatted or written unless someone listens
(one cached ``isEnabledFor`` check per mark), so the marks stay in production code. A
benchmark attaches a handler to that logger and reads ``record.created`` and
``record.phase`` (and ``record.fields``) from each record.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["enabled", "mark"]

logger = logging.getLogger("torchheal.timeline")


def enabled() -> bool:
    """Whether anyone listens to the marks (``torchheal.timeline`` enabled at DEBUG)."""
    return logger.isEnabledFor(logging.DEBUG)


def mark(phase: str, **fields: Any) -> None:
    """Records that ``phase`` happens now (a no-op unless the timeline logger is enabled).

    Args:
        phase: a dotted name, ``…begin``/``…end`` for a phase with a duration.
        fields: extra values for the record (byte counts, steps).
    """
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(phase, extra={"phase": phase, "fields": fields})
