"""QuorumThread: where a step's quorum is asked for, finished and raised.

Group rank 0 asks its in-process manager server without a thread in between; the answer is
finished where it lands when nothing in it can wait (the same quorum again, nobody to heal),
and on the quorum thread otherwise. The answer here is a future the test settles from a thread
of its own, standing in for the server's loop.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pytest

from torchheal.coordination.plan import WorldSizeMode
from torchheal.coordination.rpc.in_process import IN_PROCESS_GRACE_S
from torchheal.coordination.types import QuorumAsk, QuorumResult
from torchheal.manager.log import ManagerLogger
from torchheal.manager.quorum_thread import QuorumThread
from torchheal.manager.quorum_worker import QuorumOutcome, QuorumWorker, StepRequest
from torchheal.manager.recovery import Recovery
from torchheal.manager.telemetry import Telemetry

from .twins import MemoryTransport

pytestmark = pytest.mark.timeout(60)

S = timedelta(seconds=10)


class _PG:
    def __init__(self) -> None:
        self.configured_on: list[str] = []

    def configure(self, addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self.configured_on.append(threading.current_thread().name)


class _Server:
    """The in-process server's start call: records who asked, answers when told to."""

    def __init__(self) -> None:
        self.asked_on: list[str] = []
        self.answers: list[Future[QuorumResult]] = []

    def start(self, ask: QuorumAsk) -> Future[QuorumResult]:
        self.asked_on.append(threading.current_thread().name)
        answer: Future[QuorumResult] = Future()
        self.answers.append(answer)
        return answer

    def answer(self, result: QuorumResult | BaseException) -> None:
        """Settles the latest request from a thread named like the server's loop."""

        def settle() -> None:
            if isinstance(result, BaseException):
                self.answers[-1].set_exception(result)
            else:
                self.answers[-1].set_result(result)

        loop = threading.Thread(target=settle, name="server-loop")
        loop.start()
        loop.join()


def _quorum(quorum_id: int, **kw: Any) -> QuorumResult:
    base: dict[str, Any] = dict(
        quorum_id=quorum_id,
        replica_rank=0,
        replica_world_size=2,
        max_step=0,
        max_replica_rank=0,
        max_world_size=2,
        store_address="store:1",
    )
    base.update(kw)
    return QuorumResult(**base)


def _request(current_quorum_id: int, timeout: timedelta = S) -> StepRequest:
    return StepRequest(
        step=0,
        commit_failures=0,
        current_quorum_id=current_quorum_id,
        allow_heal=True,
        shrink_only=False,
        captured=None,
        timeout=timeout,
    )


def _thread(server: _Server | None, pg: _PG) -> tuple[QuorumThread, list[tuple[str, int]]]:
    transport = MemoryTransport({}, "a")
    worker = QuorumWorker(
        quorum_call=lambda ask: _quorum(7),
        quorum_start=server.start if server is not None else None,
        process_group=lambda: pg,
        recovery=Recovery(transport, lambda *a: "", group_rank=0, timeout=S, log=print),
        snapshot=lambda captured: captured,
        metadata=transport.metadata,
        group_rank=0,
        replica_name="a",
        use_async_quorum=True,
        init_sync=True,
        world_size_mode=WorldSizeMode.DYNAMIC,
        min_replica_size=1,
        log=ManagerLogger(lambda: 0, "a:uuid", 0),
    )
    applied: list[tuple[str, int]] = []

    def apply(outcome: QuorumOutcome) -> None:
        applied.append((threading.current_thread().name, outcome.participation.count))

    return QuorumThread(worker, apply, Telemetry("a", "a:uuid", 0)), applied


def test_the_same_quorum_again_is_finished_where_the_answer_lands() -> None:
    server, pg = _Server(), _PG()
    quorums, applied = _thread(server, pg)
    quorums.submit(_request(current_quorum_id=3))
    # Asked from the training thread itself, not handed to a thread first.
    assert server.asked_on == [threading.current_thread().name]
    assert not quorums.future.done()
    server.answer(_quorum(3))
    quorums.wait()
    assert applied == [("server-loop", 2)]
    assert pg.configured_on == []
    quorums.shutdown()


def test_a_new_quorum_is_finished_on_the_quorum_thread() -> None:
    server, pg = _Server(), _PG()
    quorums, applied = _thread(server, pg)
    quorums.submit(_request(current_quorum_id=3))
    server.answer(_quorum(4))
    quorums.wait()  # done means applied, whichever thread finished it
    assert [name for name, _ in applied] == ["async_quorum_0"]
    assert pg.configured_on == ["async_quorum_0"]
    quorums.shutdown()


def test_a_quorum_error_is_raised_once() -> None:
    server, pg = _Server(), _PG()
    quorums, applied = _thread(server, pg)
    quorums.submit(_request(current_quorum_id=3))
    server.answer(TimeoutError("no quorum in time"))
    with pytest.raises(TimeoutError, match="no quorum in time"):
        quorums.wait()
    quorums.raise_unobserved()  # already seen: not raised again at the next step
    quorums.submit(_request(current_quorum_id=3))
    server.answer(RuntimeError("lighthouse gone"))
    with pytest.raises(RuntimeError, match="lighthouse gone"):
        quorums.raise_unobserved()  # nobody waited: the next step's start raises it
    assert applied == []
    quorums.shutdown()


def test_without_a_start_call_the_quorum_thread_asks() -> None:
    pg = _PG()
    quorums, applied = _thread(None, pg)
    quorums.submit(_request(current_quorum_id=-1))
    quorums.wait()
    assert applied == [("async_quorum_0", 2)]
    assert pg.configured_on == ["async_quorum_0"]
    quorums.shutdown()


class _SlowPG(_PG):
    """A rebuild that takes ``hold_s`` (a rendezvous waiting on a slow peer, say)."""

    def __init__(self, hold_s: float) -> None:
        super().__init__()
        self._hold_s = hold_s

    def configure(self, addr: str, replica_id: str, rank: int, world_size: int) -> None:
        time.sleep(self._hold_s)  # the stimulus: a slow build, not a synchronisation
        super().configure(addr, replica_id, rank, world_size)


SHORT = timedelta(milliseconds=100)  # the server's deadline; the patience is 5 s more


def test_a_rebuild_longer_than_the_patience_for_the_answer_is_waited_for() -> None:
    # The patience is for the server's answer; the rebuild after it has timeouts of its own.
    server, pg = _Server(), _SlowPG(hold_s=SHORT.total_seconds() + IN_PROCESS_GRACE_S + 1.0)
    quorums, applied = _thread(server, pg)
    quorums.submit(_request(current_quorum_id=3, timeout=SHORT))
    server.answer(_quorum(4))
    quorums.wait()
    assert pg.configured_on == ["async_quorum_0"]
    assert [name for name, _ in applied] == ["async_quorum_0"]
    quorums.shutdown()


def test_a_server_that_never_answers_is_given_up_after_its_deadline_and_the_grace() -> None:
    server, pg = _Server(), _PG()
    quorums, _ = _thread(server, pg)
    quorums.submit(_request(current_quorum_id=3, timeout=SHORT))
    with pytest.raises(TimeoutError, match=r"did not answer the quorum request within 5\.1s"):
        quorums.wait()
    server.answer(_quorum(3))  # late: nothing waits for it any more
    quorums.shutdown()
