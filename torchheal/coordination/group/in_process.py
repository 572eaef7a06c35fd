"""Group rank 0's calls to its own manager server, which lives in its process: no gRPC.

Same deadlines and errors as ``ManagerClient``: ``quorum_in_process`` runs the ``Quorum``
handler's coroutine on the server's loop (cancelled at its deadline, as gRPC would), and
``vote_in_process`` casts from the caller's thread into the same round as ``ShouldCommit``, so a
vote that completes the round has its decision without a trip through the loop.
"""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta

import grpc

from torchheal._base.timeouts import to_seconds
from torchheal.coordination import convert
from torchheal.coordination.rpc.errors import status_error
from torchheal.coordination.rpc.in_process import IN_PROCESS_GRACE_S
from torchheal.coordination.types import QuorumAsk, QuorumResult

__all__ = ["InProcessRank", "ServerGone"]


class ServerGone(Exception):
    """The manager server shut down while a vote waited for the rest of the group."""


class InProcessRank:
    """The in-process calls of :class:`~torchheal.coordination.group.server.ManagerServer` (a
    mixin: its state is set by the server's constructor)."""

    def quorum_in_process(self, ask: QuorumAsk) -> QuorumResult:
        """The ``Quorum`` call of a rank living in this process, without the gRPC round trip.

        Same result and errors as ``ManagerClient.quorum``; the rank joins the same round as
        the gRPC ranks, and leaves it if ``ask.timeout`` passes first.
        """
        timeout_s = to_seconds(ask.timeout)
        answer = self.start_quorum_in_process(ask)
        try:
            return answer.result(timeout_s + IN_PROCESS_GRACE_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{self._quorum_what} failed: status: Cancelled, message: "
                f'"Timeout expired" (the server loop did not answer within {timeout_s:g}s)'
            ) from None

    def start_quorum_in_process(self, ask: QuorumAsk) -> concurrent.futures.Future[QuorumResult]:
        """:meth:`quorum_in_process` without waiting: the future holds its result or error.

        The answer is settled on the loop thread, with no thread in between (the training
        thread asks at the start of a step and meets the answer later), so callbacks added to
        the future must be quick.
        """
        timeout_s = to_seconds(ask.timeout)
        answer = self._quorum_in_process.start(self._join_quorum(ask, timeout_s), timeout_s)
        out: concurrent.futures.Future[QuorumResult] = concurrent.futures.Future()

        def settle(done: concurrent.futures.Future[QuorumResult]) -> None:
            try:
                # Exactly what a gRPC caller gets (fields the protocol lacks do not travel),
                # so rank 0 and the other ranks see the same result.
                result = convert.quorum_result_from_pb(convert.quorum_result_to_pb(done.result()))
            except BaseException as e:
                out.set_exception(e)
                return
            out.set_result(result)

        answer.add_done_callback(settle)
        return out

    def should_commit_in_process(
        self, group_rank: int, step: int, should_commit: bool, timeout: timedelta
    ) -> bool:
        """The ``ShouldCommit`` vote of a rank living in this process, without gRPC.

        Same arguments, result and errors as ``ManagerClient.should_commit``.
        """
        return self.vote_in_process(group_rank, step, should_commit, False, timeout)[0]

    def vote_in_process(
        self, group_rank: int, step: int, should_commit: bool, salvageable: bool, timeout: timedelta
    ) -> tuple[bool, bool]:
        """:meth:`should_commit_in_process` with the salvage: returns ``(commit, redo)``.

        Same arguments, result and errors as ``ManagerClient.vote``.
        """
        timeout_s = to_seconds(timeout)
        what = self._commit_what
        if self._shut_down:
            raise status_error(
                what, grpc.StatusCode.UNAVAILABLE, f"{self._server_name} is shut down"
            )
        try:
            round_ = self._vote.cast(group_rank, step, should_commit, salvageable)
        except ValueError as e:
            raise status_error(what, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        try:
            decision = round_.result(timeout_s)
            return decision.commit, decision.redo
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f'{what} failed: status: Cancelled, message: "Timeout expired" '
                f"(in-process deadline of {timeout_s:g}s exceeded)"
            ) from None
        except ServerGone as e:
            raise status_error(what, grpc.StatusCode.UNAVAILABLE, str(e)) from None
