"""Ask NCCL's flight recorder for a trace dump before a communicator is aborted.

NCCL watches a named pipe per rank (``$TORCH_NCCL_DEBUG_INFO_PIPE_FILE{rank}.pipe``) and dumps
its recent collective history when a line is written to it. Dumping takes a while and the
abort that follows tears the communicator down, so the caller waits before going on.
"""

from __future__ import annotations

import logging
import time

from torchheal._base.telemetry_env import NCCL_DEBUG_PIPE_ENV, nccl_debug_pipe_prefix

__all__ = [
    "TORCHFT_TRIGGER_FR_ON_ABORT",
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE_ENV_VAR",
    "trigger_nccl_fr_trace_through_pipe",
]

logger = logging.getLogger(__name__)

TORCH_NCCL_DEBUG_INFO_PIPE_FILE_ENV_VAR = NCCL_DEBUG_PIPE_ENV
# "true" asks NCCL process groups to dump a flight-recorder trace before aborting.
TORCHFT_TRIGGER_FR_ON_ABORT = "TORCHFT_TRIGGER_FR_ON_ABORT"

# How long the dump is given before the caller continues (NCCL writes it asynchronously).
_DUMP_WAIT_S = 60.0


def trigger_nccl_fr_trace_through_pipe(rank: int, wait_s: float = _DUMP_WAIT_S) -> bool:
    """Writes a dump request to this rank's flight-recorder pipe, then waits ``wait_s``.

    Returns False (nothing done) when ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is unset.
    """
    prefix = nccl_debug_pipe_prefix()
    if not prefix:
        logger.info("[rank %d] no flight-recorder pipe configured; no trace dump", rank)
        return False
    with open(f"{prefix}{rank}.pipe", "w") as pipe:
        logger.info("[rank %d] requesting a flight-recorder trace dump", rank)
        pipe.write("1\n")
        pipe.flush()
        time.sleep(wait_s)
    return True
