"""Checksum verification overlapped with receiving.

A receiver hands each block to ``BlockVerifier`` as soon as it has arrived and reads the next
while worker threads check it. Leaving the ``with`` block waits for every check, also on error
(the workers read the receive buffers); return nothing before it has exited without error.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType

from torchheal.checkpointing._format import Segment
from torchheal.checkpointing.deserialization import verify_segment
from torchheal.checkpointing.transport import CheckpointError


def default_workers() -> int:
    """Checksum threads: half the cores (the other half receive), at least 1, at most 4."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class BlockVerifier:
    """Checks received blocks against their CRC-32 on ``workers`` threads."""

    def __init__(self, workers: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(
            workers or default_workers(), thread_name_prefix="torchheal-verify"
        )
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        self._error: CheckpointError | None = None

    def __enter__(self) -> BlockVerifier:
        return self

    def submit(self, view: memoryview, seg: Segment) -> None:
        """Queues the check of ``seg`` within ``view`` (the whole storage's bytes).

        Thread-safe; raises the first mismatch already found, so a bad transfer stops early.
        """
        self.submit_batch([(view, seg)])

    def submit_batch(self, items: list[tuple[memoryview, Segment]]) -> None:
        """Queues the checks of many small blocks as one job (less per-block overhead)."""
        if self._error is not None:
            raise self._error

        def run() -> None:
            for view, seg in items:
                verify_segment(view, seg)

        future = self._pool.submit(run)
        future.add_done_callback(self._done)
        with self._lock:
            self._futures.append(future)

    def _done(self, future: Future[None]) -> None:
        error = future.exception()
        if isinstance(error, CheckpointError) and self._error is None:
            self._error = error

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Always wait: the checks read buffers the caller frees after an error.
        self._pool.shutdown(wait=True)
        if exc_type is not None:
            return
        for future in self._futures:
            future.result()  # the first failure, in stream order
