"""HealStep alone, with its step machine: a heal on the training thread, plain futures, no
servers."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

from torchheal.checkpointing import TornCheckpointError
from torchheal.coordination.plan import Participation
from torchheal.coordination.types import QuorumResult
from torchheal.manager.heal import HealStep
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import StepMachine
from torchheal.manager.quorum_worker import QuorumOutcome, Transfer


class _Host:
    """The Manager's step machine and step error."""

    def __init__(self, step: int = 3, batches: int = 30, warmup: bool = False) -> None:
        self.machine = StepMachine(
            min_replica_size=1, max_retries=None, salvage=False, warmup=warmup
        )
        self.machine.step, self.machine.batches_committed = step, batches
        self.errors: list[Exception] = []

    @property
    def counters(self) -> dict[str, int]:
        return {"step": self.machine.step, "batches_committed": self.machine.batches_committed}

    def vote_step(self, step: int) -> int:
        """The step this rank votes on with its counters at ``step``."""
        self.machine.step = step
        return self.machine.ballot(errored=False).step

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def errored(self) -> object:
        return self.errors[-1] if self.errors else None


class _Event:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def _heal(
    host: _Host,
    loaded: list[Any],
    *,
    timeout: float = 5.0,
    healed: Any = lambda: None,
) -> tuple[HealStep, list[float]]:
    waits: list[float] = []

    def load_user(user: Any) -> None:
        if user == "broken":
            raise ValueError("cannot load this")
        loaded.append(user)

    heal = HealStep(
        host=host,
        machine=host.machine,
        load_user=load_user,
        timeout=timedelta(seconds=timeout),
        waited=waits.append,
        log=ManagerLogger(lambda: host.machine.step, "unit", 0),
        healed=healed,
    )
    return heal, waits


def _outcome(
    *, healing: bool, max_step: int = 7, transfer: Future[Transfer] | None = None, **kw: Any
) -> QuorumOutcome:
    return QuorumOutcome(
        quorum=QuorumResult(quorum_id=1, max_step=max_step),
        participation=Participation(rank=None if healing else 0, count=1),
        healing=healing,
        transfer=transfer,
        **kw,
    )


def _received(user: Any = "weights") -> dict[str, Any]:
    return {"user": user, "torchft": {"step": 5, "batches_committed": 50}}


def test_a_transfer_beside_the_step_is_settled_then_loaded_at_the_quorums_step() -> None:
    host, loaded = _Host(), []
    heal, waits = _heal(host, loaded)
    assert heal.begin() is False
    future: Future[Transfer] = Future()
    heal.take_outcome(_outcome(healing=True, transfer=future))
    assert host.machine.healing and heal.pending is None and host.counters["step"] == 3

    # The transfer thread finishes while the training thread waits in settle.
    event = _Event()
    threading.Timer(0.05, future.set_result, [Transfer(_received(), [], event)]).start()
    heal.settle()
    assert heal.transfer is None and len(waits) == 1
    assert heal.pending == _received() and host.machine.pre_heal == (3, 30)
    # The sender's batch count, the quorum's step.
    assert host.counters == {"step": 7, "batches_committed": 50}
    heal.synchronize()
    assert event.synchronized == 1 and heal.recovery_event is None

    heal.apply()
    assert loaded == ["weights"] and heal.pending is None and host.machine.pre_heal is None
    assert host.errors == [] and host.counters["step"] == 7


def test_state_that_arrived_inside_the_quorum_is_taken_at_once() -> None:
    host, loaded = _Host(), []
    heal, _ = _heal(host, loaded)
    heal.take_outcome(_outcome(healing=True, received=_received()))
    assert host.counters == {"step": 7, "batches_committed": 50} and heal.pending is not None
    heal.apply()
    assert loaded == ["weights"]


def test_a_failed_load_reports_and_restores_the_counters_from_before_the_heal() -> None:
    host, loaded = _Host(), []
    heal, _ = _heal(host, loaded)
    heal.take_outcome(_outcome(healing=True, received=_received("broken")))
    heal.apply()
    assert loaded == [] and [type(e) for e in host.errors] == [ValueError]
    assert host.counters == {"step": 3, "batches_committed": 30}  # the next quorum heals again


def test_healing_with_nothing_received_fails_the_step_once() -> None:
    host, loaded = _Host(), []
    heal, _ = _heal(host, loaded)
    heal.take_outcome(_outcome(healing=True))
    heal.apply()
    assert [str(e) for e in host.errors] == ["healing without a received checkpoint"]
    # A step that already failed (say, the transfer) is not reported twice.
    heal.take_outcome(_outcome(healing=True))
    heal.apply()
    assert len(host.errors) == 1


def test_a_transfers_errors_fail_the_step_and_a_source_keeps_nothing() -> None:
    host, loaded = _Host(), []
    heal, _ = _heal(host, loaded)
    future: Future[Transfer] = Future()
    future.set_result(Transfer(_received(), [RuntimeError("send failed")]))
    heal.take_outcome(_outcome(healing=False, transfer=future))
    heal.settle()
    assert [str(e) for e in host.errors] == ["send failed"]
    assert heal.pending is None and host.counters["step"] == 3  # not a healer: nothing taken


def test_a_transfer_past_the_timeout_fails_the_step_and_its_late_state_is_dropped() -> None:
    host, loaded = _Host(), []
    heal, waits = _heal(host, loaded, timeout=0.05)
    future: Future[Transfer] = Future()
    heal.take_outcome(_outcome(healing=True, transfer=future))
    heal.settle()
    assert [type(e) for e in host.errors] == [TimeoutError] and len(waits) == 1
    future.set_result(Transfer(_received()))  # arrives after the step gave up
    heal.settle()
    assert heal.pending is None and host.counters["step"] == 3


def test_the_next_step_drains_an_unsettled_transfer_and_forgets_the_heal() -> None:
    host, loaded = _Host(), []
    heal, _ = _heal(host, loaded)
    failed: Future[Transfer] = Future()
    failed.set_exception(RuntimeError("lost"))
    heal.take_outcome(_outcome(healing=True, transfer=failed, received=_received()))
    heal.drain()  # logged and dropped, not reported: the step it belonged to is over
    assert heal.transfer is None and host.errors == []
    heal.begin()
    assert (host.machine.healing, heal.pending, host.machine.pre_heal) == (False, None, None)


def test_the_warm_up_is_one_step_and_can_be_skipped() -> None:
    heal, _ = _heal(_Host(warmup=True), [])
    assert heal.end_warmup() is False  # no step yet
    assert heal.begin() is True and heal.warming_up
    assert heal.end_warmup() is True and not heal.warming_up
    assert heal.begin() is False and heal.end_warmup() is False

    host = _Host(warmup=True)
    skipped, _ = _heal(host, [])
    host.machine.warmup_pending = False  # Manager.skip_warmup
    assert skipped.begin() is False and not skipped.warming_up


def test_a_heal_torn_part_way_fails_every_step_until_a_heal_succeeds() -> None:
    host, loaded = _Host(step=0, batches=0), []
    heal, _ = _heal(host, loaded)
    torn = TornCheckpointError("receiving into this replica's own tensors failed part way")
    future: Future[Transfer] = Future()
    future.set_result(Transfer(None, [torn]))
    heal.take_outcome(_outcome(healing=True, transfer=future))
    heal.settle()
    heal.apply()
    heal.check_torn()
    assert host.machine.torn and torn in host.errors
    # A later step that does not heal (no peer ahead of it) still fails: its state is a mix.
    host.errors.clear()
    heal.begin()
    heal.take_outcome(_outcome(healing=False))
    heal.check_torn()
    assert [type(e) for e in host.errors] == [RuntimeError]
    assert "must heal from a peer" in str(host.errors[0])
    # Made the source at step 0 (its own source died mid-transfer, every survivor is torn):
    # its state becomes the initial state, or the same plan would come back every round and
    # no step would ever commit (issue 40, bug 2).
    host.errors.clear()
    heal.begin()
    heal.take_outcome(_outcome(healing=False, max_step=0))
    heal.check_torn()
    assert not host.machine.torn and host.errors == []
    host.machine.torn = True
    # Torn inside the quorum (a synchronous heal) counts the same.
    other_host = _Host(step=0, batches=0)
    other, _ = _heal(other_host, [])
    other.take_outcome(_outcome(healing=True, errors=[torn]))
    assert other_host.machine.torn
    # A heal that succeeds mends it.
    host.errors.clear()
    heal.begin()
    heal.take_outcome(_outcome(healing=True, received=_received()))
    heal.apply()
    heal.check_torn()
    assert not host.machine.torn and host.errors == [] and loaded == ["weights"]


def test_a_failed_heal_votes_on_the_step_its_group_healed_to_until_it_gets_there() -> None:
    # A group of several ranks: this rank's receive failed, the others' may have succeeded.
    host, loaded = _Host(step=3), []
    heal, _ = _heal(host, loaded)
    future: Future[Transfer] = Future()
    future.set_result(Transfer(None, [ConnectionResetError("reset")]))
    heal.take_outcome(_outcome(healing=True, max_step=7, transfer=future))
    heal.settle()
    assert host.counters["step"] == 3 and len(host.errors) == 1
    assert host.vote_step(3) == 7  # the step its group healed to, not its own
    # The next step's quorum failed (no heal): its vote stays at 7, a retry of that step.
    heal.begin()
    assert host.vote_step(3) == 7
    # A heal that succeeds brings the counters there; from then on they alone count.
    heal.take_outcome(_outcome(healing=True, max_step=9, received=_received()))
    heal.apply()
    assert host.counters["step"] == 9 and host.vote_step(9) == 9
    assert host.vote_step(2) == 2  # a later rollback of the counters is the user's


def test_a_heal_that_succeeds_votes_on_its_counters() -> None:
    host, loaded = _Host(step=3), []
    heal, _ = _heal(host, loaded)
    heal.take_outcome(_outcome(healing=True, max_step=7, received=_received()))
    heal.apply()
    assert host.vote_step(host.counters["step"]) == 7
    assert host.vote_step(8) == 8


def test_a_failed_load_votes_on_the_step_its_group_healed_to() -> None:
    host, loaded = _Host(step=3), []
    heal, _ = _heal(host, loaded)
    heal.take_outcome(_outcome(healing=True, max_step=7, received=_received("broken")))
    heal.apply()
    assert host.counters["step"] == 3 and host.vote_step(3) == 7


def test_a_heal_that_loads_reports_it_and_one_that_fails_does_not() -> None:
    # The group's manager server tells the lighthouse whose history the group holds
    # (quorum.superseded): a group that healed holds its source's, not its own last commit's.
    for received, want in ((_received("broken"), []), (_received(), [True])):
        host, loaded = _Host(step=3), []
        healed: list[bool] = []
        heal, _ = _heal(host, loaded, healed=lambda healed=healed: healed.append(True))
        heal.take_outcome(_outcome(healing=True, max_step=7, received=received))
        heal.apply()
        assert healed == want
