"""The thread a step's quorum runs on, and the future the training loop waits on.

With an asynchronous quorum, ``start_quorum`` hands the step's quorum to one background thread
(which runs :meth:`QuorumWorker.run <torchheal.manager.quorum_worker.QuorumWorker.run>`, times
it for telemetry and hands the outcome to the Manager) and returns; the training loop meets the result in ``wait_quorum`` (directly, or through a
collective or a participation query). A quorum error is raised to the training loop exactly
once: either when something waits for it, or else at the next ``start_quorum``, so an error
nobody waited for is not lost and one already seen is not raised twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from torchheal.manager.quorum_worker import QuorumOutcome, StepRequest
from torchheal.manager.telemetry import Telemetry

__all__ = ["QuorumThread"]


class QuorumThread:
    """One background thread for the quorums, and the future of the latest one.

    Args:
        run: the quorum thread's work for one step (``QuorumWorker.run``).
        apply: takes in its outcome, on the quorum thread (the Manager).
        telemetry: counts quorums, their failures and the training thread's waits (a quorum
            already done when asked for costs nothing and is not counted as a wait).
    """

    def __init__(
        self,
        run: Callable[[StepRequest], QuorumOutcome],
        apply: Callable[[QuorumOutcome], None],
        telemetry: Telemetry,
    ) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async_quorum")
        self._run = run
        self._apply = apply
        self._telemetry = telemetry
        #: The latest step's quorum; None before the first ``start_quorum``.
        self.future: Future[None] | None = None
        # The quorum future whose error already reached the training loop.
        self._raised: Future[None] | None = None

    def raise_unobserved(self) -> None:
        """Raises the last quorum's error if nothing has seen it yet (at a step's start)."""
        previous = self.future
        if previous is None:
            return
        error = previous.exception()
        if error is not None and previous is not self._raised:
            self._raised = previous
            raise error

    def submit(self, request: StepRequest) -> None:
        """Runs this step's quorum in the background.

        Args:
            request: the step's arguments.
        """
        self.future = self._executor.submit(self._quorum, request)

    def _quorum(self, request: StepRequest) -> None:
        # Quorum thread. A quorum RPC error propagates: wait() raises it.
        started = time.perf_counter()
        try:
            outcome = self._run(request)
        except BaseException:
            self._telemetry.quorum_failed()
            raise
        self._telemetry.quorum(
            outcome.quorum,
            request.current_quorum_id,
            outcome.participation.count,
            time.perf_counter() - started,
        )
        self._apply(outcome)

    def skip(self) -> None:
        """This step has no quorum: waiting for it returns at once."""
        done: Future[None] = Future()
        done.set_result(None)
        self.future = done

    def wait(self) -> None:
        """Waits for the latest quorum; re-raises its error.

        Raises:
            AssertionError: no quorum was started.
            TimeoutError, RuntimeError: the quorum RPC failed.
        """
        future = self.future
        assert future is not None, "must call start_quorum before wait_quorum"
        try:
            if future.done():
                future.result()
            else:  # the training thread waits: count it
                started = time.perf_counter()
                try:
                    future.result()
                finally:
                    self._telemetry.waited(time.perf_counter() - started)
        except BaseException:
            self._raised = future
            raise

    def shutdown(self, wait: bool = True) -> None:
        """Stops the thread.

        Args:
            wait: wait for the quorum in flight to finish.
        """
        self._executor.shutdown(wait=wait)
