"""The divergence guard's shell: fingerprints the state, moves the words, does the verdict.

What to compare, when, and who repairs is decided in :mod:`torchheal.manager.divergence`
(pure). This module runs on the training thread in ``should_commit`` before the vote, when every
member is at the quorum's step. It fingerprints the state (:mod:`torchheal.manager.fingerprint`)
and exchanges it in one SUM allreduce of a fixed-size int64 vector (each member in its own slot),
so nothing new crosses any wire. The exchange runs beside the next step, whose vote takes its
verdict, so no group waits at a compared step. A mismatch is logged and counted; under
``repair`` a rank outside the reference class fails the next step (``StepMachine.must_repair``)
and heals, under ``stop`` it raises after its vote.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp
from torch.futures import Future

from torchheal._base import manager_env
from torchheal.coordination.types import QuorumResult
from torchheal.futures import Expiry, future_wait, timed_then
from torchheal.manager.allreduce import start_allreduce
from torchheal.manager.divergence import (
    DEFAULT_INTERVAL,
    POLICIES,
    GuardSettings,
    Schedule,
    Slot,
    Verdict,
    agreed,
    decode,
    differing_tensors,
    encode,
    judge,
    slot_words,
    tensor_count,
    tensor_words,
    verdict_awaited,
)
from torchheal.manager.fingerprint import Fingerprint, fingerprint
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import StepMachine
from torchheal.metrics.trainer import TrainerStats

__all__ = ["DivergenceError", "DivergenceGuard", "guard_settings"]

_SIGN = 1 << 63


class DivergenceError(RuntimeError):
    """The replica groups hold different state and the policy is ``stop``."""


@dataclass(frozen=True)
class _Pending:
    """An exchange under way: what its verdict needs once it arrives.

    Args:
        quorum: the quorum of the step compared.
        policy: what a mismatch does (the quorum's agreed policy).
        mine: this rank's fingerprint (None: it sent none).
        vector: the vector being summed.
        ended: completes when the sum has arrived (or failed, timed out, or was expired).
    """

    quorum: QuorumResult
    policy: str
    mine: Fingerprint | None
    vector: torch.Tensor
    ended: Future[Any]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= _SIGN else value


class DivergenceGuard:
    """One rank's divergence guard.

    Args:
        settings: this rank's interval and policy (its group advertises its rank 0's; each
            step follows what the quorum's participants advertise alike).
        machine: the step machine (its step, heals and the repair vote).
        quorum: returns this step's quorum result (None before the first).
        read_state: returns the state a healer would receive (``Manager._manager_state_dict``).
        can_read: whether the state may be read now (nothing registered, or reads blocked:
            this rank sends no fingerprint).
        process_group: returns the cross-replica process group.
        broken: whether the exchange must not run: the process group was
            aborted, or this step skipped a collective its peers ran (after a failure), so an
            exchange would pair with another collective of theirs.
        fail: fails this step (a failed exchange).
        expiry: returns the connected process group's expiry (a lost peer or this group's
            drop ends the exchange at once, as it ends the step's other collectives).
        timeout: how long the exchange may take.
        log: the Manager's logger.
        stats: the trainer's counters.
    """

    def __init__(
        self,
        settings: GuardSettings,
        *,
        machine: StepMachine,
        quorum: Callable[[], QuorumResult | None],
        read_state: Callable[[], dict[str, Any]],
        can_read: Callable[[], bool],
        process_group: Callable[[], Any],
        broken: Callable[[], bool],
        fail: Callable[[Exception], None],
        expiry: Callable[[], Expiry],
        timeout: timedelta,
        log: ManagerLogger,
        stats: TrainerStats,
    ) -> None:
        settings.validate()
        self.settings = settings
        self.schedule = Schedule()
        self._machine = machine
        self._quorum = quorum
        self._read_state = read_state
        self._can_read = can_read
        self._pg = process_group
        self._broken = broken
        self._fail = fail
        self._expiry = expiry
        self._timeout = timeout
        self._log = log
        self._stats = stats
        self._last: QuorumResult | None = None
        #: The exchange started at the last compared step, judged at the next step's vote.
        self._pending: _Pending | None = None
        #: The settings the participants of this quorum advertise alike (None: no exchange).
        self.agreed: GuardSettings | None = None
        #: A stop to raise after this step's vote.
        self.stop: str | None = None
        #: The last verdict (tests and the demo read it).
        self.verdict: Verdict | None = None

    def check(self, pg_errored: bool = False) -> None:
        """Training thread, before the vote: takes the verdict of the last exchange and acts on
        it, then starts this step's exchange when one is due.

        The exchange runs beside the next step, so the faster group never waits for the slower;
        a group that differs votes no one step later.

        Args:
            pg_errored: the process group reported an error this step (it is not asked again).
        """
        quorum = self._quorum()
        if quorum is None or quorum is self._last or self._machine.warming_up:
            return  # no quorum yet, or this step's exchange already ran (a redo's loop)
        self._last = quorum
        self._take_verdict(quorum, pg_errored)
        if quorum.replica_world_size < 2:
            return  # alone in its quorum: nobody to compare with (nor to keep in step with)
        heals = quorum.max_world_size < quorum.replica_world_size or quorum.max_step == 0
        self.agreed = agreed(quorum.replica_ids)
        reason = self.schedule.due(
            quorum_id=quorum.quorum_id, step=quorum.max_step, heals=heals, settings=self.agreed
        )
        if reason is None or self.agreed is None:
            return
        if pg_errored or self._broken():
            # The step fails anyway and the next quorum has a fresh id; the peers' exchange
            # fails or times out as their skipped collectives do. (A step that failed after
            # its collectives still runs it: its peers wait for it.)
            return
        mine = self._fingerprint(quorum)
        interval, policy = self.agreed.advertised
        slot = Slot(
            rank=quorum.replica_rank,
            interval=interval,
            policy=policy,
            step=self._machine.step,
            eligible=mine is not None,
            last_heal=self._machine.healed_at,
            entries=() if mine is None else mine.entries,
            tensors=0 if mine is None else len(mine.tensors),
        )
        started = self._start(quorum, encode(slot), slot_words())
        if started is not None:
            self._pending = _Pending(quorum, self.agreed.policy, mine, *started)

    def _take_verdict(self, now: QuorumResult, pg_errored: bool) -> None:
        """Judges the exchange started at the last compared step, and does what it says."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        then = pending.quorum
        if not verdict_awaited(
            then_quorum_id=then.quorum_id,
            now_quorum_id=now.quorum_id,
            ended=pending.ended.done(),
        ):
            self._log.warning(
                f"divergence guard: the exchange of step {then.max_step} has not ended and "
                f"quorum {then.quorum_id} is gone: its verdict is dropped"
            )
            return
        try:
            future_wait(pending.ended, 2 * self._timeout)  # timed_then ends it first
        except Exception as e:  # that step committed or not on its own: no verdict, that's all
            self._log.warning(
                f"divergence guard: the exchange of step {then.max_step} failed: {e!r}"
            )
            return
        slots = decode(pending.vector.cpu().tolist(), then.replica_world_size)
        verdict = judge(slots, then.max_step)
        tensors: dict[int, tuple[int, ...]] = {}
        count = tensor_count(slots)
        mine = pending.mine
        # Which tensors differ: a second exchange, among the same members (the same quorum id:
        # every member judged the same words alike, so all run it; in a new quorum nobody does).
        if not verdict.matched and count and now.quorum_id == then.quorum_id:
            if not (pg_errored or self._broken()):
                own = tensor_words([] if mine is None else list(mine.tensor_digests), count)
                started = self._start(now, own, 2 * count)
                summed = None if started is None else self._wait(*started)
                if summed is not None:  # (else the keys are reported alone; the step failed)
                    tensors = differing_tensors(summed, count, verdict)
        if mine is not None:
            self._act(then, pending.policy, verdict, mine, tensors)

    def _fingerprint(self, quorum: QuorumResult) -> Fingerprint | None:
        machine = self._machine
        if machine.step != quorum.max_step or machine.torn:
            return None
        if not self._can_read():
            return None
        try:
            return fingerprint(self._read_state())
        except Exception as e:  # a state_dict that fails here fails at a heal too: report it
            self._log.warning(f"divergence guard: fingerprinting the state failed: {e!r}")
            return None

    def _start(
        self, quorum: QuorumResult, own: list[int], size: int
    ) -> tuple[torch.Tensor, Future[Any]] | None:
        """Starts summing a vector where this member wrote ``own`` at its rank's region of
        ``size`` words; None when it could not start (the step fails)."""
        words = [0] * (size * quorum.replica_world_size)
        offset = quorum.replica_rank * size
        words[offset : offset + size] = [_signed(w) for w in own]
        pg = self._pg()
        vector = torch.tensor(words, dtype=torch.int64, device=_device(pg))
        expiry = self._expiry()  # before it starts, as the Manager's allreduce takes it
        try:
            work = start_allreduce(pg, vector, ReduceOp.SUM, False)
            return vector, timed_then(work.get_future(), self._timeout, _value, expiry)
        except Exception as e:
            # Its peers' would pair with this member's next collective: the step fails (as
            # when any of its collectives fails).
            self._fail(e)
            return None

    def _wait(self, vector: torch.Tensor, ended: Future[Any]) -> list[int] | None:
        """The summed vector, or None when the sum failed (the step fails)."""
        try:
            future_wait(ended, 2 * self._timeout)  # timed_then ends it first
        except Exception as e:
            self._fail(e)
            return None
        return vector.cpu().tolist()

    def _act(
        self,
        quorum: QuorumResult,
        policy: str,
        verdict: Verdict,
        mine: Fingerprint,
        tensors: dict[int, tuple[int, ...]],
    ) -> None:
        self.verdict = verdict
        stats = self._stats
        stats.divergence_checks += 1
        if verdict.matched:
            stats.last_verified_step = verdict.step
            return
        stats.divergence_mismatches += 1
        message = describe(verdict, quorum.replica_ids, mine, tensors, policy)
        self._log.log(logging.ERROR, "%s", message)
        if policy == "stop":
            self.stop = message
            self._machine.must_repair = message
        elif policy == "repair" and quorum.replica_rank in verdict.repair:
            if self._machine.healed_at <= verdict.step:  # (else healed since: nothing to do)
                self._machine.must_repair = message

    def raise_if_stopped(self) -> None:
        """After the vote: raises :class:`DivergenceError` under ``stop`` once a mismatch was seen."""
        if self.stop is not None:
            raise DivergenceError(self.stop)


def guard_settings(interval: int | None, policy: str | None) -> GuardSettings:
    """The Manager's guard settings: its arguments, then the environment, then the default
    (every :data:`~torchheal.manager.divergence.DEFAULT_INTERVAL` steps, ``repair``).

    Args:
        interval: ``divergence_check_interval`` (None: ``TORCHHEAL_DIVERGENCE_CHECK_INTERVAL``,
            else the default; 0: off).
        policy: ``on_divergence`` (None: ``TORCHHEAL_ON_DIVERGENCE``, else ``repair``).

    Raises:
        ValueError: an argument or variable is invalid.
    """
    settings = GuardSettings(
        *manager_env.divergence_guard(interval, policy, default_interval=DEFAULT_INTERVAL)
    )
    settings.validate()
    return settings


def _value(fut: Any) -> Any:
    return fut.value()  # raises the collective's error, the timeout's or the expiry's


def _device(pg: Any) -> torch.device:
    """Where the exchanged vector lives: NCCL (XCCL) reduces device tensors only; the rest,
    CPU ones."""
    name = pg.getBackendName().lower()
    if "nccl" in name and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in name and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


#: Tensors named per group in a report (the rest are counted).
NAMED_TENSORS = 5


def describe(
    verdict: Verdict,
    replica_ids: list[str],
    mine: Fingerprint,
    tensors: dict[int, tuple[int, ...]],
    policy: str,
) -> str:
    """The mismatch report: which groups, which step, which keys and tensors, who repairs."""

    def name(rank: int) -> str:
        return replica_ids[rank] if rank < len(replica_ids) else f"rank {rank}"

    parts = []
    for rank, indices in sorted(verdict.differing.items()):
        keys = [mine.keys[i] if i < len(mine.keys) else f"key #{i}" for i in indices]
        differ = tensors.get(rank, ())
        named = [mine.tensors[i] if i < len(mine.tensors) else f"#{i}" for i in differ]
        more = len(named) - NAMED_TENSORS
        detail = ", ".join(named[:NAMED_TENSORS]) + (f" and {more} more" if more > 0 else "")
        parts.append(
            f"{name(rank)} differs in {', '.join(keys)}" + (f" (tensors {detail})" if named else "")
        )
    what = {
        "repair": "the groups outside it vote no and heal from it at the next quorum",
        "stop": "every group stops",
        "warn": "nothing is done (warn)",
    }[policy if policy in POLICIES else "warn"]
    return (
        f"divergence at step {verdict.step}: replica groups hold different state; "
        f"reference {', '.join(name(r) for r in verdict.reference)} ({verdict.rule}); "
        f"{'; '.join(parts)}; {what}"
    )
