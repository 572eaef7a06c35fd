"""The lighthouse's quorum rounds: who waits for a quorum, when to decide, and answering a round.

:class:`QuorumRounds` holds the one ``LighthouseState`` under a lock and feeds it heartbeats,
requests and ticks; the decision itself is the pure ``quorum.py``. It runs once per batch of
requests read together (once per request would make a round O(N^2)), and a changed quorum is
saved to the store before anyone receives it. Loop thread only, except ``snapshot``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from torchheal._wire import torchft_pb2 as pb
from torchheal.coordination import convert
from torchheal.coordination.lighthouse.answers import Issued, member_entry, quorum_bytes
from torchheal.coordination.lighthouse.store import QuorumStore, StoreError
from torchheal.coordination.quorum import (
    LighthouseConfig,
    LighthouseState,
    forget_stale_heartbeats,
    heartbeat,
    issue,
    join,
    propose,
    quorum_compute,
    requeue,
    restore,
    withdraw,
)
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

__all__ = ["QuorumRounds", "Waiter"]

# A child of the lighthouse's logger, so configuring that one configures the whole lighthouse.
logger: logging.Logger = logging.getLogger("torchheal.coordination.lighthouse.rounds")

# Heartbeats older than this are dropped so the map stays bounded (the reference keeps them
# forever). At least a minute, so a status view still shows recently departed replicas.
MIN_HEARTBEAT_RETENTION_S = 60.0
PRUNE_INTERVAL_S = 1.0


class Waiter:
    """One request waiting for a quorum that includes its member; ``deliver`` gets it once."""

    __slots__ = ("deadline", "deliver", "entry", "expired", "member", "timer")

    def __init__(
        self, member: QuorumMember, entry: bytes, deliver: Callable[[Issued], None]
    ) -> None:
        self.member = member
        self.entry = entry
        self.deliver = deliver
        # With a timeout (wait_until): its monotonic deadline and whom to tell; the timer may
        # come later (arm_timers).
        self.deadline: float | None = None
        self.expired: Callable[[], None] | None = None
        self.timer: asyncio.TimerHandle | None = None


class QuorumRounds:
    """The quorum rounds of one lighthouse: state, waiting requests, decisions and answers.

    ``observed`` spares building the observer's arguments when there is none; what ``store``
    holds is restored at once (:class:`StoreError` if unreadable).
    """

    def __init__(
        self,
        config: LighthouseConfig,
        notify: Callable[..., None],
        observed: bool,
        store: QuorumStore | None = None,
    ) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.state = LighthouseState()
        self._store = store
        # (quorum id, member ids) of the last record saved in the store.
        self._saved: tuple[int, tuple[str, ...]] | None = None
        if store is not None:
            saved = store.load()
            if saved is not None:
                self._saved = _record_key(saved)
                restore(self.state, saved, time.monotonic())
                logger.info(
                    "Restored quorum %d (%s) from the lighthouse's store: the next quorum "
                    "takes a higher id",
                    saved.quorum_id,
                    [m.replica_id for m in saved.participants],
                )
        self._notify = notify
        self._observed = observed
        # replica_id -> the participant's message as received (its quorum entry).
        self._entries: dict[str, bytes] = {}
        # Requests waiting for a quorum, in arrival order (a dict used as an ordered set).
        self._waiters: dict[Waiter, None] = {}
        # When the current round's first request arrived (for the round latency).
        self._round_started: float | None = None
        self._tick_scheduled = False
        self._tick_handle: asyncio.Handle | None = None
        # A request just brought the round to the last quorum's size: decide at run_due().
        self._due = False
        # Longer timeouts get their timer at the next periodic tick (arm_timers).
        self._timer_at_once_s = 2.0 * config.quorum_tick_ms / 1000.0
        self._last_reason: str | None = None
        self._last_prune = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Called with (quorum before, quorum issued) once it was delivered.
        self.on_issued: Callable[[Quorum | None, Quorum], None] | None = None

    # ------------------------------------------------------------------------------------------
    # Heartbeats and requests

    def heartbeat(self, replica_id: str) -> None:
        """A group said it is alive."""
        with self.lock:
            heartbeat(self.state, replica_id, time.monotonic())

    def wait(
        self,
        member: QuorumMember,
        raw: pb.QuorumMember,
        deliver: Callable[[Issued], None],
        lineage: int = 0,
    ) -> Waiter:
        """Join the round with ``member``; ``deliver`` gets the first quorum that includes it.

        Left out, the request stays for the next one until :meth:`forget` or :meth:`withdraw`.
        ``lineage``: the quorum the group last committed in (0: not said).
        """
        waiter = Waiter(member, member_entry(raw), deliver)
        now = time.monotonic()
        with self.lock:
            state = self.state
            join(state, member, now, lineage)
            self._entries[member.replica_id] = waiter.entry
            if self._round_started is None:
                self._round_started = now
            prev = state.prev_quorum
            if prev is not None and len(state.participants) == len(prev.participants):
                # Likely a complete round: the caller decides at run_due(), a loop turn sooner.
                self._due = True
        self._waiters[waiter] = None
        if self._observed:
            self._notify("joined", member, now)
        self.schedule_tick()
        return waiter

    def wait_until(
        self,
        member: QuorumMember,
        raw: pb.QuorumMember,
        deliver: Callable[[Issued], None],
        timeout_s: float,
        expired: Callable[[], None],
        lineage: int = 0,
    ) -> Waiter:
        """As :meth:`wait`, but after ``timeout_s`` the request is withdrawn and ``expired`` called.

        Long timeouts get their timer at the next periodic tick (:meth:`arm_timers`): most
        requests are answered sooner, and a timer is a good part of a request's cost.
        """
        waiter = self.wait(member, raw, deliver, lineage)
        waiter.deadline = time.monotonic() + timeout_s
        waiter.expired = expired
        if timeout_s <= self._timer_at_once_s:
            waiter.timer = self._running_loop().call_later(timeout_s, self._expire, waiter)
        return waiter

    def arm_timers(self) -> None:
        """Set the timer of every request that waits without one (periodic tick)."""
        now = time.monotonic()
        loop = self._running_loop()
        for waiter in self._waiters:
            if waiter.timer is None and waiter.deadline is not None:
                waiter.timer = loop.call_later(
                    max(0.0, waiter.deadline - now), self._expire, waiter
                )

    def _expire(self, waiter: Waiter) -> None:
        waiter.timer = None
        if self.withdraw(waiter) and waiter.expired is not None:
            waiter.expired()

    def forget(self, waiter: Waiter) -> None:
        """Stop waiting but leave the member in the round, as the reference does for a unary
        call that went away."""
        self._waiters.pop(waiter, None)

    def withdraw(self, waiter: Waiter) -> bool:
        """Take the request back: nobody waits for it any more. Returns whether it still waited."""
        if waiter not in self._waiters:
            return False
        del self._waiters[waiter]
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        with self.lock:
            withdraw(self.state, waiter.member)
        return True

    def restore(self, raw: pb.Quorum | None, source: str) -> None:
        """Learn of a quorum a group (``source``) reports was issued before this lighthouse
        started (``quorum.restore``)."""
        if raw is None:
            return
        try:
            quorum = convert.quorum_from_pb(raw, strict_data=False)
        except (ValueError, TypeError) as e:
            logger.warning("Ignoring the last quorum reported by %s: %s", source, e)
            return
        with self.lock:
            adopted = restore(self.state, quorum, time.monotonic())
        if adopted:
            logger.warning(
                "Adopted quorum %d (%s) reported by %s: it was issued before this lighthouse "
                "started; the next quorum takes a higher id",
                quorum.quorum_id,
                [m.replica_id for m in quorum.participants],
                source,
            )
            self.schedule_tick()

    # ------------------------------------------------------------------------------------------
    # Decisions

    def schedule_tick(self) -> None:
        """Decide once the requests that are ready to be read have joined.

        Requests arriving together share one decision; it is scheduled twice over
        (:meth:`_scheduled_tick`) so what the loop's next socket poll finds is read before it.
        """
        if self._tick_scheduled:
            return
        self._tick_scheduled = True
        self._tick_handle = self._running_loop().call_soon(self._scheduled_tick, True)

    def run_due(self) -> None:
        """Decide now (the scheduled tick's decision, sooner) if a request likely completed
        the round; called once everything one read brought has joined."""
        if not self._due:
            return
        handle = self._tick_handle
        if handle is not None:
            handle.cancel()  # this decision is the one it would have made
            self._tick_handle = None
            self._tick_scheduled = False
        try:
            self.tick()
        except Exception:  # as the loop would for the scheduled tick: the caller goes on
            logger.exception("deciding the quorum round failed")

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _scheduled_tick(self, after_reads: bool) -> None:
        if after_reads:
            # The loop has just looked at its sockets: what it found is read after this
            # callback, in this turn; decide after that, in the next.
            self._tick_handle = self._running_loop().call_soon(self._scheduled_tick, False)
            return
        self._tick_scheduled = False
        self._tick_handle = None
        self.tick()

    def tick(self) -> None:
        """Run one decision; deliver an issued quorum. Loop thread only."""
        self._due = False
        now = time.monotonic()
        with self.lock:
            before = self.state.prev_quorum
            wall = Timestamp.from_float(time.time())
            quorum, reason = propose(self.state, self.config, now, wall)
            if reason != self._last_reason:
                # Ticks run every 100 ms; repeating an unchanged reason would flood the log.
                logger.info("Quorum status: %s", reason)
                self._last_reason = reason
                if self._observed:
                    self._notify("reason_changed", reason, now)
            if now - self._last_prune >= PRUNE_INTERVAL_S:
                self._last_prune = now
                retention = max(MIN_HEARTBEAT_RETENTION_S, self.config.heartbeat_timeout_ms / 1e3)
                forgotten = forget_stale_heartbeats(self.state, now, retention)
                if forgotten:
                    logger.info("Forgot heartbeats of departed replicas: %s", forgotten)
            if quorum is None:
                return
            if not self._save(quorum):
                # Nobody may receive a quorum not on record: the next tick tries again.
                return
            # A member issued below the step it asked at (it heals) goes out as issued.
            entries = self._entries
            for member in quorum.participants:
                asked = self.state.participants.get(member.replica_id)
                if asked is not None and asked[1] is not member:
                    entries[member.replica_id] = member_entry(convert.member_to_pb(member))
            issue(self.state, quorum, now)
            round_s = 0.0 if self._round_started is None else now - self._round_started
            self._round_started = None
            # Participants were cleared by issue(); their messages go with the issued quorum.
            self._entries = {}
        self._deliver(quorum, entries, now)
        if self.on_issued is not None:
            self.on_issued(before, quorum)
        if self._observed:
            self._notify("quorum_issued", quorum, reason, round_s, now)

    def _save(self, quorum: Quorum) -> bool:
        """Record ``quorum`` if its id or members changed; False when the store failed. Under
        the lock: saves are rare and small."""
        if self._store is None:
            return True
        key = _record_key(quorum)
        if key == self._saved:
            return True
        try:
            self._store.save(quorum)
        except StoreError as e:
            logger.error("Not issuing quorum %d: %s", quorum.quorum_id, e)
            return False
        self._saved = key
        return True

    def _deliver(self, quorum: Quorum, entries: dict[str, bytes], now: float) -> None:
        """Answer every waiting request the quorum includes; put the others back. One pass."""
        member_ids = frozenset(m.replica_id for m in quorum.participants)
        issued = Issued(quorum.quorum_id, member_ids, quorum_bytes(quorum, entries))
        if logger.isEnabledFor(logging.INFO):  # the member list is built only to be logged
            logger.info(
                "Issued quorum %d with %d participants: %s",
                quorum.quorum_id,
                len(member_ids),
                [m.replica_id for m in quorum.participants],
            )
        waiters = self._waiters
        answered = [w for w in waiters if w.member.replica_id in member_ids]
        if len(answered) < len(waiters):
            with self.lock:
                for waiter in waiters:
                    if waiter.member.replica_id in member_ids:
                        continue
                    logger.info(
                        "Replica %s not in quorum %d, retrying",
                        waiter.member.replica_id,
                        quorum.quorum_id,
                    )
                    requeue(self.state, waiter.member, now)
                    self._entries[waiter.member.replica_id] = waiter.entry
                    if self._round_started is None:
                        self._round_started = now
        for waiter in answered:
            del waiters[waiter]
            if waiter.timer is not None:
                waiter.timer.cancel()
                waiter.timer = None
            try:
                waiter.deliver(issued)
            except Exception:  # one broken connection must not keep the others waiting
                logger.exception("delivering quorum %d failed", quorum.quorum_id)

    # ------------------------------------------------------------------------------------------
    # Reading

    def snapshot(self) -> tuple[str, Quorum | None, dict[str, float], list[str], int]:
        """``(reason, prev_quorum, heartbeats ages, waiting ids, quorum_id)``; any thread."""
        now = time.monotonic()
        with self.lock:
            _, reason = quorum_compute(self.state, self.config, now)
            prev = self.state.prev_quorum
            heartbeats = {rid: now - seen for rid, seen in self.state.heartbeats.items()}
            waiting = sorted(self.state.participants)
            quorum_id = self.state.quorum_id
        return reason, prev, heartbeats, waiting, quorum_id


def _record_key(quorum: Quorum) -> tuple[int, tuple[str, ...]]:
    return quorum.quorum_id, tuple(m.replica_id for m in quorum.participants)
