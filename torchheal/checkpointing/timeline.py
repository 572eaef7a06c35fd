"""Phase marks of a heal, on both sides, for benchmarks and debugging.

:func:`mark` logs the moment a phase begins or ends on ``torchheal.timeline`` at DEBUG; it
costs one cached ``isEnabledFor`` check unless someone listens. A benchmark attaches a handler
and reads ``record.created``, ``record.phase`` and ``record.fields``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["mark"]

logger = logging.getLogger("torchheal.timeline")


def mark(phase: str, **fields: Any) -> None:
    """Records that ``phase`` (dotted, ``…begin``/``…end``) happens now, with ``fields``."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(phase, extra={"phase": phase, "fields": fields})
