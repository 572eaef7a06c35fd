"""The thread a step's quorum runs on, and the future the training loop waits on.

With an asynchronous quorum, ``start_quorum`` hands the quorum to the background and the loop
meets the result in ``wait_quorum``. A quorum error is raised exactly once: when something waits
for it, or else at the next ``start_quorum``.

On group rank 0, whose manager server is in-process, the training thread sends the request
itself (:meth:`QuorumWorker.start <torchheal.manager.quorum_worker.QuorumWorker.start>`) and a
step with nothing to rebuild or move is finished where the answer lands: every thread hand-off
takes the GIL from the training thread. Other ranks ask over gRPC on the quorum thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeoutError

from torchheal.coordination.rpc.in_process import IN_PROCESS_GRACE_S
from torchheal.coordination.types import QuorumResult
from torchheal.manager.quorum_worker import QuorumOutcome, QuorumWorker, StepRequest
from torchheal.manager.telemetry import Telemetry

__all__ = ["QuorumThread"]


class QuorumThread:
    """One background thread for the quorums, and the future of the latest one.

    Args:
        worker: the step's quorum work (``run``, or ``start`` then ``finish``).
        apply: takes in its outcome (the Manager), on the thread that finished it.
        telemetry: counts quorums, their failures and the training thread's waits (a quorum
            already done when asked for costs nothing and is not counted as a wait).
    """

    def __init__(
        self,
        worker: QuorumWorker,
        apply: Callable[[QuorumOutcome], None],
        telemetry: Telemetry,
    ) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async_quorum")
        self._worker = worker
        self._apply = apply
        self._telemetry = telemetry
        #: The latest step's quorum; None before the first ``start_quorum``.
        self.future: Future[None] | None = None
        # The quorum future whose error already reached the training loop.
        self._raised: Future[None] | None = None
        # How long a waiter gives the server's answer to a quorum asked without the thread
        # (None: asked on it), and that answer. Once answered, the rest of the quorum's work
        # (rebuilding the process group, moving state) runs under timeouts of its own.
        self._patience_s: float | None = None
        self._answer: Future[QuorumResult] | None = None

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
        started = time.perf_counter()
        answer = self._worker.start(request)
        if answer is None:
            self._patience_s = self._answer = None
            self.future = self._executor.submit(self._quorum, request)
            return
        done: Future[None] = Future()
        # The server's loop answers by the request's deadline; this much more is for a loop
        # that never answers at all (as the blocking in-process call allows).
        self._patience_s = request.timeout.total_seconds() + IN_PROCESS_GRACE_S
        self._answer = answer
        self.future = done
        answer.add_done_callback(lambda a: self._answered(request, a, done, started))

    def _quorum(self, request: StepRequest) -> None:
        # Quorum thread. A quorum RPC error propagates: wait() raises it.
        started = time.perf_counter()
        try:
            outcome = self._worker.run(request)
        except BaseException:
            self._telemetry.quorum_failed()
            raise
        self._finished(request, outcome, started)

    def _answered(
        self,
        request: StepRequest,
        answer: Future[QuorumResult],
        done: Future[None],
        started: float,
    ) -> None:
        # Where the answer landed (the server's loop thread, or the training thread when it
        # was already there): quick work only.
        try:
            quorum = answer.result()
        except BaseException as e:
            self._telemetry.quorum_failed()
            done.set_exception(e)
            return
        if not self._worker.blocks(request, quorum):
            self._finish(request, quorum, done, started)
            return
        try:
            self._executor.submit(self._finish, request, quorum, done, started)
        except BaseException as e:  # shut down
            done.set_exception(e)

    def _finish(
        self, request: StepRequest, quorum: QuorumResult, done: Future[None], started: float
    ) -> None:
        try:
            self._finished(request, self._worker.finish(request, quorum), started)
        except BaseException as e:
            done.set_exception(e)
            return
        done.set_result(None)

    def _finished(self, request: StepRequest, outcome: QuorumOutcome, started: float) -> None:
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
                    self._wait_answer()
                    future.result()
                finally:
                    self._telemetry.waited(time.perf_counter() - started)
        except BaseException:
            self._raised = future
            raise

    def _wait_answer(self) -> None:
        """Waits for the server's answer as long as its deadline allows, and no longer.

        Raises:
            TimeoutError: the server's loop never answered.
        """
        answer = self._answer
        if answer is None:
            return
        try:
            answer.exception(self._patience_s)  # its error, if any, reaches the quorum's future
        except FuturesTimeoutError:
            raise TimeoutError(
                f"the manager server did not answer the quorum request within "
                f"{self._patience_s:g}s (its loop is stuck)"
            ) from None

    def shutdown(self, wait: bool = True) -> None:
        """Stops the thread.

        Args:
            wait: wait for the quorum in flight to finish.
        """
        self._executor.shutdown(wait=wait)
