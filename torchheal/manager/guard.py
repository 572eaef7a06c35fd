"""The divergence guard's shell: fingerprints the state, moves the words, does the verdict.

What to compare, when, and who repairs is decided in :mod:`torchheal.manager.divergence`
(pure); this module runs on the training thread in ``should_commit`` before the vote (every
member of the quorum is at the quorum's step then, a healer's state loaded), and

* fingerprints the state a healer would receive (:mod:`torchheal.manager.fingerprint`),
* exchanges it in one SUM allreduce of a fixed-size int64 vector on the cross-replica process
  group, each member writing its words in its own slot (its index in the group) and zeros
  elsewhere: nothing new on any wire, so it works with either lighthouse,
* reports a mismatch (an ERROR line naming groups, step and keys; counters) and does what the
  policy says: under ``repair`` a rank outside the reference class fails its step like a torn
  replica (``StepMachine.must_repair``), so its group falls one step behind and the next quorum
  heals it; under ``stop`` every rank that sees the mismatch raises after its vote.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from torchheal.coordination.types import QuorumResult
from torchheal.futures import Expiry, future_wait, timed_then
from torchheal.manager.allreduce import start_allreduce
from torchheal.manager.divergence import (
    POLICIES,
    GuardSettings,
    Schedule,
    Slot,
    Verdict,
    decode,
    differing_tensors,
    encode,
    judge,
    slot_words,
    tensor_count,
    tensor_words,
)
from torchheal.manager.fingerprint import Fingerprint, fingerprint
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import StepMachine
from torchheal.metrics.trainer import TrainerStats

__all__ = ["DivergenceError", "DivergenceGuard"]

_SIGN = 1 << 63


class DivergenceError(RuntimeError):
    """The replica groups hold different state and the policy is ``stop``."""


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= _SIGN else value


class DivergenceGuard:
    """One rank's divergence guard.

    Args:
        settings: interval and policy.
        machine: the step machine (its step, heals and the repair vote).
        quorum: returns this step's quorum result (None before the first).
        read_state: returns the state a healer would receive (``Manager._manager_state_dict``).
        can_read: whether the state may be read now (nothing registered, or reads blocked:
            this rank sends no fingerprint).
        process_group: returns the cross-replica process group.
        broken: whether the exchange must not run: the process group was
            aborted, or this step skipped a collective its peers ran (after a failure), so an
            exchange would pair with another collective of theirs.
        fail: fails this step (a failed exchange: the next quorum gets a fresh id, so every
            member starts again with the handshake).
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
        self.schedule = Schedule(settings)
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
        #: A stop to raise after this step's vote.
        self.stop: str | None = None
        #: The last verdict (tests and the demo read it).
        self.verdict: Verdict | None = None

    def check(self, pg_errored: bool = False) -> None:
        """Training thread, before the vote: exchanges fingerprints when due and acts.

        Args:
            pg_errored: the process group reported an error this step (it is not asked again).
        """
        quorum = self._quorum()
        if quorum is None or quorum is self._last or self._machine.warming_up:
            return  # no quorum yet, or this step's exchange already ran (a redo's loop)
        self._last = quorum
        if quorum.replica_world_size < 2:
            return  # alone in its quorum: nobody to compare with (nor to keep in step with)
        heals = quorum.max_world_size < quorum.replica_world_size or quorum.max_step == 0
        reason = self.schedule.due(quorum_id=quorum.quorum_id, step=quorum.max_step, heals=heals)
        if reason is None:
            return
        if pg_errored or self._broken():
            # The step fails anyway and the next quorum has a fresh id; the peers' exchange
            # fails or times out as their skipped collectives do. (A step that failed after
            # its collectives still runs it: its peers wait for it.)
            self.schedule.exchanged(quorum.quorum_id, [])
            return
        mine = self._fingerprint(quorum)
        slots = self._exchange(quorum, mine)
        if not self.schedule.exchanged(quorum.quorum_id, slots):
            return
        verdict = judge(slots, quorum.max_step)
        tensors: dict[int, tuple[int, ...]] = {}
        count = tensor_count(slots)
        if not verdict.matched and count:  # every member judged alike: all run this one
            own = tensor_words([] if mine is None else list(mine.tensor_digests), count)
            summed = self._allreduce(quorum, own, 2 * count)
            if summed is not None:  # (else the keys are reported alone; the step failed)
                tensors = differing_tensors(summed, count, verdict)
        if mine is not None:
            self._act(quorum, verdict, mine, tensors)

    def _fingerprint(self, quorum: QuorumResult) -> Fingerprint | None:
        machine = self._machine
        if not self.settings.on or machine.step != quorum.max_step or machine.torn:
            return None
        if not self._can_read():
            return None
        try:
            return fingerprint(self._read_state())
        except Exception as e:  # a state_dict that fails here fails at a heal too: report it
            self._log.warning(f"divergence guard: fingerprinting the state failed: {e!r}")
            return None

    def _exchange(self, quorum: QuorumResult, mine: Fingerprint | None) -> list[Slot | None]:
        interval, policy = self.settings.advertised
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
        summed = self._allreduce(quorum, encode(slot), slot_words())
        return [] if summed is None else decode(summed, quorum.replica_world_size)

    def _allreduce(self, quorum: QuorumResult, own: list[int], size: int) -> list[int] | None:
        """Sums a vector where this member wrote ``own`` at its rank's region of ``size``
        words; None when it failed (the step fails)."""
        words = [0] * (size * quorum.replica_world_size)
        offset = quorum.replica_rank * size
        words[offset : offset + size] = [_signed(w) for w in own]
        pg = self._pg()
        vector = torch.tensor(words, dtype=torch.int64, device=_device(pg))
        expiry = self._expiry()  # before it starts, as the Manager's allreduce takes it
        try:
            work = start_allreduce(pg, vector, ReduceOp.SUM, False)
            ended = timed_then(work.get_future(), self._timeout, _value, expiry)
            future_wait(ended, 2 * self._timeout)  # timed_then ends it first
        except Exception as e:
            # No verdict, and the step fails: its failed commit gives the next quorum a fresh
            # id, so the members cannot disagree on whether the guard is armed.
            self._fail(e)
            return None
        return vector.cpu().tolist()

    def _act(
        self,
        quorum: QuorumResult,
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
        message = describe(verdict, quorum.replica_ids, mine, tensors, self.settings.policy)
        self._log.log(logging.ERROR, "%s", message)
        policy = self.settings.policy
        if policy == "stop":
            self.stop = message
            self._machine.must_repair = message
        elif policy == "repair" and quorum.replica_rank in verdict.repair:
            self._machine.must_repair = message

    def raise_if_stopped(self) -> None:
        """After the vote: raises :class:`DivergenceError` under ``stop`` once a mismatch was seen."""
        if self.stop is not None:
            raise DivergenceError(self.stop)


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
