"""Manager with one replica group: real lighthouse, ManagerServer and process groups."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import ReduceOp

from tests.cluster import TIMEOUT, lighthouse, replica
from tests.manager.twins import PendingGroup
from torchheal._base.manager_timeouts import TimeoutBudgetWarning
from torchheal.coordination.types import Notice, NoticeKind
from torchheal.manager import ExceptionWithTraceback, Manager
from torchheal.process_group.dummy import ProcessGroupDummy
from torchheal.process_group.gloo import ProcessGroupGloo
from torchheal.process_group.work import _DummyWork
from torchheal.process_group.wrappers import FakeProcessGroupWrapper
from torchheal.work import _ManagedWork

pytestmark = pytest.mark.timeout(60)


def test_state_dict_round_trip_and_layout() -> None:
    with lighthouse() as lh, replica(lh, "a", weight=2.0) as r:
        m = r.manager
        assert m.state_dict() == {"step": 0, "batches_committed": 0}
        m.load_state_dict({"step": 1234, "batches_committed": 2345})
        assert m.current_step() == 1234 and m.batches_committed() == 2345
        sd = m._manager_state_dict()
        assert sd.keys() == {"user", "torchft"}
        assert sd["torchft"] == {"step": 1234, "batches_committed": 2345}
        assert sd["user"].keys() == {"default"}
        assert sd["user"]["default"]["weight"] is r.weight  # references, not copies


def test_happy_path() -> None:
    with lighthouse() as lh, replica(lh, "a") as r:
        m = r.manager
        assert m.num_participants() == 0 and m.participating_rank() is None
        assert m._quorum_id == -1
        for step in range(2):
            m.start_quorum()
            t = torch.full((4,), 3.0)
            work = m.allreduce(t)
            assert isinstance(work, _ManagedWork)
            assert work.wait() is True
            assert torch.equal(t, torch.full((4,), 3.0))  # one participant: sum / 1
            assert m.participating_rank() == 0 and m.num_participants() == 1
            assert m.is_participating()
            assert m.should_commit() is True
            assert m.current_step() == step + 1
        assert m._quorum_id == 1
        assert m.batches_committed() == 2
        assert m._healing is False and m.errored() is None


def test_allreduce_error_skips_the_step_and_next_quorum_clears_it() -> None:
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        m = r.manager
        m.start_quorum()
        m.wait_quorum()
        first_quorum = m._quorum_id
        pg.report_future_error(RuntimeError("injected failure"))
        t = torch.ones(2)
        work = m.allreduce(t)
        work.wait()
        assert m.errored() is not None
        assert "injected failure" in str(m.errored())
        # Later collectives of the step are no-ops that leave the tensor alone.
        t2 = torch.full((2,), 7.0)
        later = m.allreduce(t2)
        assert isinstance(later, _DummyWork) and later.wait()
        assert torch.equal(t2, torch.full((2,), 7.0))
        assert m.should_commit() is False
        assert m.current_step() == 0 and m._commit_failures == 1

        m.start_quorum()
        assert m.errored() is None
        m.wait_quorum()
        # The failed commit made the lighthouse issue a new quorum id: the PG was rebuilt.
        assert m._quorum_id > first_quorum
        t3 = torch.ones(2)
        assert m.allreduce(t3).wait()
        assert m.should_commit() is True
        assert m.current_step() == 1 and m._commit_failures == 0


def test_should_commit_waits_for_a_collective_nobody_waited_on() -> None:
    # The training loop issues an allreduce and never waits on it (nor on its future); the
    # collective fails. The vote must still see the failure and reject the step.
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        m = r.manager
        m.start_quorum()
        m.wait_quorum()
        pg.report_future_error(RuntimeError("late collective failure"))
        m.allreduce(torch.ones(2))  # the work is dropped on the floor
        assert m.errored() is None  # nothing has surfaced it yet
        assert m.should_commit() is False
        assert "late collective failure" in str(m.errored())
        assert m.current_step() == 0


def test_pg_errored_is_surfaced_at_should_commit() -> None:
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        r.manager.start_quorum()
        r.manager.wait_quorum()
        pg._record_error(RuntimeError("asynchronous backend failure"))
        assert r.manager.should_commit() is False
        assert "asynchronous backend failure" in str(r.manager.errored())


def test_report_error() -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        m.start_quorum()
        assert m.errored() is None
        m.report_error(ValueError("bad batch"))
        err = m.errored()
        assert isinstance(err, ExceptionWithTraceback)
        assert isinstance(err.original_exception, ValueError)
        assert "bad batch" in str(err) and err.stack_trace
        assert m.should_commit() is False


def test_wrap_future_error_and_timeout() -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        m.start_quorum()
        fut: torch.futures.Future[int] = torch.futures.Future()
        wrapped = m.wrap_future(fut, default=-1)
        fut.set_exception(RuntimeError("remote failure"))
        assert wrapped.wait() == -1
        assert "remote failure" in str(m.errored())

        m.start_quorum()
        assert m.errored() is None
        never: torch.futures.Future[int] = torch.futures.Future()
        wrapped = m.wrap_future(never, default=5, timeout=timedelta(milliseconds=10))
        assert wrapped.wait() == 5  # a future that never completes: only the timeout ends it
        assert isinstance(m.errored().original_exception, TimeoutError)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_avg_divides_by_participants(dtype: torch.dtype) -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        m.start_quorum()
        m.wait_quorum()
        m._participating_replica_world_size = 5  # as if five replicas took part
        t = torch.full((4,), 10.0, dtype=dtype)
        assert m.allreduce(t).wait()
        assert t.dtype == dtype
        torch.testing.assert_close(t, torch.full((4,), 2.0, dtype=dtype))


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_other_ops_are_not_normalised(op: ReduceOp, dtype: torch.dtype) -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        m.start_quorum()
        m.wait_quorum()
        m._participating_replica_world_size = 5
        t = torch.full((4,), 10, dtype=dtype)
        assert m.allreduce(t, reduce_op=op).wait()
        assert torch.equal(t, torch.full((4,), 10, dtype=dtype))


def test_avg_on_integers_is_rejected_and_healing_zeroes() -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        m.start_quorum()
        with pytest.raises(ValueError, match="floating point"):
            m.allreduce(torch.ones(2, dtype=torch.int64))
        m._healing = True  # a healing replica contributes zeros
        t = torch.full((3,), 4.0)
        assert m.allreduce(t).wait()
        assert torch.equal(t, torch.zeros(3))


def test_quantized_allreduce_averages() -> None:
    with lighthouse() as lh, replica(lh, "a") as r:
        m = r.manager
        m.start_quorum()
        t = torch.linspace(-1.0, 1.0, 64).reshape(8, 8)
        expected = t.clone()
        assert m.allreduce(t, should_quantize=True).wait()
        torch.testing.assert_close(t, expected, atol=0.02, rtol=0.0)
        assert m.should_commit()


def test_max_retries() -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy(), max_retries=2) as r:
        m = r.manager

        def failing_step() -> bool:
            m.start_quorum()
            m.report_error(RuntimeError("fail"))
            return m.should_commit()

        assert failing_step() is False
        assert failing_step() is False
        m.start_quorum()
        assert m.should_commit() is True  # success resets the count
        assert m._commit_failures == 0
        assert failing_step() is False
        assert failing_step() is False
        with pytest.raises(
            RuntimeError,
            match=r"should_commit failed 3 times consecutively, exceeding max_retries=2",
        ):
            failing_step()


def test_state_dict_lock() -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        m.allow_state_dict_read()  # idempotent when already allowed
        assert m._is_state_dict_read_allowed
        m.disallow_state_dict_read()
        m.disallow_state_dict_read()  # idempotent
        assert not m._is_state_dict_read_allowed
        assert m._state_dict_lock.w_locked()

        started = threading.Event()
        done = threading.Event()
        result: list[dict] = []

        def reader() -> None:
            started.set()
            result.append(m._manager_state_dict())
            done.set()

        thread = threading.Thread(target=reader)
        thread.start()
        started.wait(5)
        assert not done.wait(0.2)  # blocked while disallowed
        m.allow_state_dict_read()
        assert done.wait(5)
        thread.join(5)
        assert result[0]["torchft"] == {"step": 0, "batches_committed": 0}
        m.allow_state_dict_read()
        assert not m._state_dict_lock.w_locked()


def test_registry() -> None:
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        with pytest.raises(AssertionError, match="default"):
            m.register_state_dict_fn("default", lambda s: None, lambda: {})
        with pytest.warns(DeprecationWarning, match="register_state_dict_fn"):
            m.set_state_dict_fns(lambda s: None, lambda: {"x": 1})
        assert m._manager_state_dict()["user"]["set_state_dict_fns"] == {"x": 1}


def test_quorum_and_commit_timeouts_are_the_ones_given() -> None:
    # min_replicas=2 with a single group: no quorum can form. The message names the deadline
    # that was applied (the call's 10 ms, not the manager's 10 s); how fast is bench/'s job.
    applied = r"status: Cancelled, message: \"Timeout expired\".*deadline of 0\.01s"
    with lighthouse(min_replicas=2) as lh:
        with replica(lh, "a", pg=ProcessGroupDummy(), use_async_quorum=False) as r:
            with pytest.raises(TimeoutError, match=applied):
                r.manager.start_quorum(timeout=timedelta(milliseconds=10))
            with pytest.raises(TimeoutError, match=applied):
                r.manager.should_commit(timeout=timedelta(milliseconds=10))
    # A fresh lighthouse: "a" stays registered on the old one until its heartbeat expires.
    with lighthouse(min_replicas=2) as lh, replica(lh, "b", pg=ProcessGroupDummy()) as r:
        r.manager.start_quorum(timeout=timedelta(milliseconds=10))  # async: returns
        with pytest.raises(TimeoutError):
            r.manager.wait_quorum()
        # An error already raised to the loop is not raised again by the next step.
        r.manager.start_quorum(timeout=timedelta(milliseconds=10))
        with pytest.raises(TimeoutError):
            r.manager.should_commit(timeout=timedelta(milliseconds=10))


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "99")
    monkeypatch.setenv("TORCHHEAL_TIMEOUT_SEC", "7")
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "30")
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "9")
    with lighthouse() as lh, replica(lh, "a", pg=ProcessGroupDummy()) as r:
        m = r.manager
        assert m._timeout == timedelta(seconds=7)
        assert m._quorum_timeout == timedelta(seconds=30)
        assert m._connect_timeout == timedelta(seconds=9)
        # Used consistently: the default transport and the state-dict lock got it too.
        assert m._state_dict_lock._timeout == 7
    monkeypatch.setenv("TORCHHEAL_QUORUM_TIMEOUT_SEC", "soon")
    with pytest.raises(ValueError, match="TORCHHEAL_QUORUM_TIMEOUT_SEC"):
        Manager(
            pg=ProcessGroupDummy(),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            rank=0,
            world_size=1,
            store_addr="localhost",
            store_port=1,
        )


def test_timeout_budget_warning() -> None:
    with lighthouse() as lh:
        with pytest.warns(TimeoutBudgetWarning, match=r"quorum_timeout \(0:00:02\) < timeout"):
            with replica(
                lh,
                "a",
                pg=ProcessGroupDummy(),
                timeout=timedelta(seconds=30),
                quorum_timeout=timedelta(seconds=2),
            ):
                pass


def _counting_callbacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts every Python callback chained on any future from now on."""
    count = [0]
    then, add_done_callback = torch.futures.Future.then, torch.futures.Future.add_done_callback

    def counted_then(self, callback):  # type: ignore[no-untyped-def]
        count[0] += 1
        return then(self, callback)

    def counted_add(self, callback):  # type: ignore[no-untyped-def]
        count[0] += 1
        return add_done_callback(self, callback)

    monkeypatch.setattr(torch.futures.Future, "then", counted_then)
    monkeypatch.setattr(torch.futures.Future, "add_done_callback", counted_add)
    return count


def test_a_gradient_bucket_costs_one_callback_on_its_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DDP's comm hook hands Manager.allreduce's future on (as_future). Every Python callback
    # of the chain runs with the GIL on the thread completing the collective (Gloo's) while
    # backward goes on: the error check, the averaging, the timeout and the swallowing run
    # as one.
    pg = PendingGroup()
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        m = r.manager
        m.start_quorum()
        m.wait_quorum()
        m._participating_replica_world_size = 4
        t = torch.full((4,), 8.0)
        callbacks = _counting_callbacks(monkeypatch)
        out = m.allreduce(t).as_future()
        assert callbacks[0] == 1
        future, tensors = pg.issued[-1]
        future.set_result(tensors)
        assert out.wait() is t
        torch.testing.assert_close(t, torch.full((4,), 2.0))
        assert m.errored() is None

        failed = torch.full((4,), 8.0)
        out = m.allreduce(failed).as_future()
        assert callbacks[0] == 2
        future, _ = pg.issued[-1]
        future.set_exception(RuntimeError("peer gone"))
        assert out.wait() is failed  # swallowed: the bucket as it was, not averaged
        torch.testing.assert_close(failed, torch.full((4,), 8.0))
        assert "peer gone" in str(m.errored())
        assert m._telemetry.stats.allreduce_errors == 1  # the recording work saw it once
        assert m.should_commit() is False


def test_a_bucket_that_times_out_is_not_a_collective_error() -> None:
    pg = PendingGroup()
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        m = r.manager
        m._timeout = timedelta(milliseconds=10)
        m.start_quorum()
        m.wait_quorum()
        t = torch.ones(2)
        out = m.allreduce(t).as_future()
        assert out.wait() is t  # never completed: only the timeout ends it
        assert isinstance(m.errored().original_exception, TimeoutError)
        assert m._telemetry.stats.allreduce_errors == 0
        future, tensors = pg.issued[-1]
        future.set_result(tensors)  # late: nothing runs any more
        assert m._telemetry.stats.allreduce_errors == 0


def test_a_collective_after_a_lost_peers_abort_is_skipped_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every failure of a peer aborts the survivors' process group (fail fast); a collective
    # issued after that abort cannot start. That is the expected path of every failure, so it
    # is one warning naming the lost group, not a traceback in every survivor's log.
    with lighthouse() as lh, replica(lh, "a") as r:
        m = r.manager
        m.start_quorum()
        m.wait_quorum()
        member, quorum_id = next(iter(m._connected.members)), m._connected.quorum_id
        # What the manager server calls when the lighthouse says a member is gone.
        m._on_notice(Notice(NoticeKind.LOST, member, quorum_id, "connection ended"))
        with caplog.at_level(logging.INFO, logger="torchheal.manager"):
            work = m.allreduce(torch.ones(2))
        assert isinstance(work, _DummyWork)
        assert m.should_commit() is False
        skipped = [rec for rec in caplog.records if "allreduce not started" in rec.getMessage()]
        assert len(skipped) == 1 and skipped[0].levelno == logging.WARNING, caplog.text
        # The lost group says it all: not also the aborted backend's words for the same thing.
        assert skipped[0].message.endswith(
            f"the process group was aborted as replica group {member} of quorum {quorum_id} "
            "is lost (connection ended)"
        ), skipped[0].message
        assert all(rec.exc_info is None for rec in caplog.records), caplog.text

        # The next quorum's group is adopted: an unexpected failure keeps its traceback.
        m.start_quorum()
        m.wait_quorum()
        assert m._connected.aborted_for is None


def test_a_step_whose_every_collective_fails_logs_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A lost peer fails every bucket's allreduce of the step: one line says the step failed,
    # the other failures go to debug (a survivor's log had four lines and two tracebacks per
    # kill on the GPU check's DDP run).
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
    with lighthouse() as lh, replica(lh, "a", pg=pg) as r:
        m = r.manager
        m.start_quorum()
        m.wait_quorum()
        futures = []
        for i in range(3):
            pg.report_future_error(RuntimeError(f"peer reset, bucket {i}"))
            futures.append(m.allreduce(torch.ones(2)).get_future())
        with caplog.at_level(logging.DEBUG, logger="torchheal.manager"):
            for fut in futures:
                fut.wait()
            assert m.should_commit() is False
        failed = [rec for rec in caplog.records if "peer reset" in rec.getMessage()]
        assert len(failed) == 3, caplog.text
        assert [rec.levelno for rec in failed] == [logging.WARNING] + [logging.DEBUG] * 2
        assert all(rec.exc_info is None for rec in failed), caplog.text
        assert "peer reset, bucket 2" in str(m.errored())  # the latest error, as the reference
