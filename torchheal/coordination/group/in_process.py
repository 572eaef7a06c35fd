"""Group rank 0's calls to its own manager server, which lives in its process: no gRPC.

Same deadlines and errors as :class:`~torchheal.coordination.clients.manager_client.ManagerClient`:
``quorum_in_process`` runs the very coroutine behind the ``Quorum`` handler on the server's loop
(cancelled when its deadline passes, as gRPC cancels a handler;
:class:`~torchheal.coordination.rpc.in_process.InProcessCaller`), and ``vote_in_process`` casts
its vote from the caller's thread into the same round the ``ShouldCommit`` handler casts into
(``vote.py``): when that vote completes the round (a group of one rank, or rank 0 voting last)
the decision is back without a trip through the loop.
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

        Same result and errors as ``ManagerClient.quorum``; the
        rank joins the same round as the ranks calling over gRPC, and leaves it if
        ``ask.timeout`` passes first.

        Args:
            ask: the rank's request.

        Raises:
            TimeoutError: no quorum within ``ask.timeout``.
            RuntimeError: the request was rejected, the lighthouse call failed, this group is
                not in the quorum, or the server is shut down.
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

        The request goes to the server's loop from this thread and the answer is settled on
        the loop thread, with no thread in between (the training thread asks at the start of
        a step and meets the answer later). Callbacks added to the future run on the loop
        thread, so they must be quick; a waiter gives up at ``ask.timeout`` plus
        :data:`~torchheal.coordination.rpc.in_process.IN_PROCESS_GRACE_S` (a stuck loop).

        Args:
            ask: the rank's request.
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

        Args:
            group_rank: the caller's index in its replica group.
            step: the step voted on.
            should_commit: the caller's vote.
            salvageable: with a "no": a redo of the step would cure the caller's failure.
            timeout: deadline of the call (waits for all ranks to vote).

        Raises:
            TimeoutError: not all ranks voted within ``timeout``.
            RuntimeError: the vote was rejected, or the server is shut down.
        """
        # The vote is cast on this thread; the vote that completes the round (always, in a
        # group of one rank) has its answer at once, without waiting on the event loop.
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
