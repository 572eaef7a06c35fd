"""The fail-fast tests' job: replica groups as processes the test kills, freezes and restarts.

The test process plays the scheduler. It runs the lighthouse (``tests.cluster.lighthouse``),
starts each group as ``python -m tests.failfast.worker`` (warm, forked from a template that
imported torch once: ``tests/warm.py``) and reads the workers' event lines as they come, so it
can act at a precise point (kill a group after a step, freeze one inside its comm hook) and hold
a restart back until the survivors have shown they go on without it.

Every wait polls a condition with a deadline; only processes this job started are ever signalled,
by their own pid. A worker that exits in a way the test did not cause fails the wait at once, with
the tail of its log.

Groups of several ranks (``ranks``): each incarnation of a group is one process per rank, meeting
in a store this job hosts for that incarnation. Rank r of every group reduces with rank r of the
others, and a heal sends rank r's state to rank r, so rank r of the job is a history of its own:
when every group makes the first quorum, the reference's rule takes each rank's state from a
different group (the "primary" is picked by rank), so the ranks of one group can start, and then
stay, apart. The events of
rank 0 are ``events`` (what the helpers of one-rank jobs read), the others' ``rank_events``;
:meth:`Job.finish` keeps every rank's final weights (``final``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import warm
from tests.failfast.worker import PREFIX

ROOT = Path(__file__).resolve().parents[2]

Event = dict[str, Any]


@dataclass
class Proc:
    """One incarnation of one group (its rank 0; ``others``: its other ranks' processes)."""

    group: int
    incarnation: int
    popen: subprocess.Popen[str]
    log: Path
    out: Path
    started: float
    rank: int = 0
    killed: bool = False  # the test SIGKILLed it (or it was told to kill itself)
    release: Path | None = None  # the FIFO it reads a line from where it holds
    reader: threading.Thread | None = field(default=None, repr=False)
    others: list[Proc] = field(default_factory=list)

    def ranks(self) -> list[Proc]:
        """Every rank's process of this incarnation, rank 0 first."""
        return [self, *self.others]


class Job:
    """Replica groups of ``tests.failfast.worker`` against one lighthouse.

    Args:
        tmp: a directory for logs, the target file and the final states.
        lighthouse: the lighthouse's URL.
        groups: the job's group count (the workers' notion of a full commit).
        impl: "torchheal" or "torchft" (the reference's Manager).
        timeout_s: the workers' collective and commit timeout.
        device: where every worker trains ("cpu" or "cuda").
        ranks: processes (ranks) per group.
    """

    def __init__(
        self,
        tmp: Path,
        lighthouse: str,
        groups: int,
        *,
        impl: str = "torchheal",
        timeout_s: float = 10.0,
        device: str = "cpu",
        ranks: int = 1,
    ) -> None:
        self.tmp = tmp
        self.lighthouse = lighthouse
        self.groups = groups
        self.impl = impl
        self.timeout_s = timeout_s
        self.device = device
        self.ranks = ranks
        self.target_file = tmp / "target"
        self.procs: dict[int, list[Proc]] = {}
        self.events: list[Event] = []  # rank 0's: the job's history
        self.rank_events: list[Event] = []  # the other ranks' (each has a "rank")
        self._stores: list[dist.TCPStore] = []  # groups of several ranks meet in these
        # Every rank's final weights, by (group, rank): set by finish().
        self.final: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._cond = threading.Condition()

    # -- processes ------------------------------------------------------------------------

    def start(
        self, group: int, *flags: str, per_rank: dict[int, tuple[str, ...]] | None = None
    ) -> Proc:
        """Starts the next incarnation of ``group``, every rank of it.

        Args:
            flags: more worker options, for every rank.
            per_rank: worker options for one rank alone (an injected failure of one rank).
        """
        incarnation = len(self.procs.get(group, []))
        per_rank = per_rank or {}
        if self.ranks == 1:
            proc = self._spawn(group, incarnation, 0, [*flags, *per_rank.get(0, ())])
        else:
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            self._stores.append(store)
            shared = [*flags, "--ranks", str(self.ranks), "--store-port", str(store.port)]
            ranks = [
                self._spawn(
                    group, incarnation, r, [*shared, "--rank", str(r), *per_rank.get(r, ())]
                )
                for r in range(self.ranks)
            ]
            proc, proc.others = ranks[0], ranks[1:]
        self.procs.setdefault(group, []).append(proc)
        return proc

    def _spawn(self, group: int, incarnation: int, rank: int, flags: list[str]) -> Proc:
        name = f"g{group}i{incarnation}" + (f"r{rank}" if rank else "")
        log = self.tmp / f"{name}.log"
        out = self.tmp / f"{name}.pt"
        release = self.tmp / f"{name}.release"
        os.mkfifo(release)
        args = [
            "--impl",
            self.impl,
            "--group",
            str(group),
            "--incarnation",
            str(incarnation),
            "--groups",
            str(self.groups),
            "--lighthouse",
            self.lighthouse,
            "--target-file",
            str(self.target_file),
            "--out",
            str(out),
            "--timeout",
            str(self.timeout_s),
            "--release",
            str(release),
            *(["--device", self.device] if self.device != "cpu" else []),
            *flags,
        ]
        log.touch()
        popen = warm.start("tests.failfast.worker", args)
        proc = Proc(group, incarnation, popen, log, out, time.time(), rank=rank, release=release)
        proc.reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        proc.reader.start()
        return proc

    def current(self, group: int) -> Proc:
        return self.procs[group][-1]

    def _read(self, proc: Proc) -> None:
        """Takes the worker's events as they come; the rest of its output (its stderr is
        merged in) goes to its log."""
        assert proc.popen.stdout is not None
        with open(proc.log, "a", encoding="utf-8") as log:
            for line in proc.popen.stdout:
                if not line.startswith(PREFIX):
                    log.write(line)
                    log.flush()
                    continue
                event = json.loads(line[len(PREFIX) :])
                event.setdefault("group", proc.group)
                event.setdefault("inc", proc.incarnation)
                event["rank"] = proc.rank
                with self._cond:
                    (self.rank_events if proc.rank else self.events).append(event)
                    if event["kind"] not in ("step", "reduce"):
                        self._cond.notify_all()  # a marker a test may act on at once
        with self._cond:
            self._cond.notify_all()  # its exit may be what a waiter looks for

    def signal(self, group: int, sig: signal.Signals) -> float:
        """Sends ``sig`` to every rank of ``group``'s current incarnation that still runs (rank
        0 must); returns when (wall clock)."""
        proc = self.current(group)
        assert proc.popen.poll() is None, f"g{group} is not running"
        now = time.time()
        for p in proc.ranks():
            if p.popen.poll() is None:
                p.killed = p.killed or sig == signal.SIGKILL
                p.popen.send_signal(sig)
        return now

    def kill(self, group: int) -> float:
        """SIGKILLs every rank of ``group``'s current incarnation still running, and reaps them
        all (a rank told to kill itself included); returns when it was sent."""
        proc = self.current(group)
        when = time.time()
        for p in proc.ranks():
            p.killed = True
            if p.popen.poll() is None:
                p.popen.kill()
        for p in proc.ranks():
            p.popen.wait(timeout=30)
        return when

    def release(self, group: int, rank: int = 0) -> None:
        """Lets a group (one rank of it) that holds in its comm hook (``--hold-after``) go on."""
        proc = self.current(group).ranks()[rank]
        # The worker holds its FIFO open for reading from its start: this never waits, and
        # fails (ENXIO) only when the worker is gone.
        fd = os.open(proc.release, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"go\n")
        finally:
            os.close(fd)

    def expect_death(self, group: int) -> None:
        """The group's current process will SIGKILL itself (``--die-after``); its other ranks,
        if any, the test kills (:meth:`kill`)."""
        for p in self.current(group).ranks():
            p.killed = True

    def all_procs(self) -> list[Proc]:
        """Every process this job started, every rank."""
        return [r for procs in self.procs.values() for p in procs for r in p.ranks()]

    # -- waiting --------------------------------------------------------------------------

    def wait_for(self, what: str, predicate: Callable[[list[Event]], Any], timeout_s: float) -> Any:
        """Polls ``predicate(events)`` until it returns something truthy, which is returned.

        Raises:
            AssertionError: the deadline passed (``what`` says what was awaited), or a process
                exited in a way the test did not cause.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                result = predicate(self.events)
                if result:
                    return result
                self._check_exits()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out after {timeout_s:.0f}s waiting for {what}\n"
                        + self.describe()
                        + self._stacks()
                    )
                # Steps come every few ms: look again every 0.1 s rather than on each of them.
                self._cond.wait(min(left, 0.1))

    def _check_exits(self) -> None:
        for p in self.all_procs():
            code = p.popen.poll()
            if code not in (None, 0) and not (p.killed and code == -signal.SIGKILL):
                raise AssertionError(
                    f"g{p.group} incarnation {p.incarnation} rank {p.rank} exited with {code}\n"
                    + self.describe()
                )

    def _stacks(self) -> str:
        """Every running worker's thread stacks (faulthandler, on SIGUSR1), for a timeout's
        message: where a group that stopped making progress waits."""
        running = [p for p in self.all_procs() if p.popen.poll() is None]
        sizes = [p.log.stat().st_size for p in running]
        for p in running:
            p.popen.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 3.0
        lines = []
        for p, size in zip(running, sizes, strict=True):
            # The dump is written by the worker's own handler; wait (bounded) until it lands.
            while (
                time.monotonic() < deadline
                and "Thread 0x" not in p.log.read_text(errors="replace")[size:]
            ):
                self._cond.wait(0.05)
            dump = p.log.read_text(errors="replace")[size:].splitlines()
            lines.append(f"--- g{p.group}i{p.incarnation}r{p.rank} stacks")
            lines += [f"    {t}" for t in dump[:200]]
        return "\n" + "\n".join(lines)

    def describe(self) -> str:
        """Each process's state, last events and log tail (for failure messages)."""
        lines = []
        for p in self.all_procs():
            mine = [
                e
                for e in (self.rank_events if p.rank else self.events)
                if (e["group"], e["inc"], e["rank"]) == (p.group, p.incarnation, p.rank)
            ]
            lines.append(
                f"--- g{p.group}i{p.incarnation}r{p.rank} exit={p.popen.poll()} "
                f"killed={p.killed} events={len(mine)} last={mine[-3:]}"
            )
            tail = p.log.read_text(errors="replace").splitlines()[-15:]
            lines += [f"    {t}" for t in tail]
        return "\n".join(lines)

    # -- queries ----------------------------------------------------------------------------

    @staticmethod
    def commits(events: list[Event], group: int | None = None, since: float = 0.0) -> list[Event]:
        """Committed step events (of ``group``, after wall time ``since``)."""
        return [
            e
            for e in events
            if e["kind"] == "step"
            and e["committed"]
            and (group is None or e["group"] == group)
            and e["time"] > since
        ]

    @staticmethod
    def healed_first(
        events: list[Event], group: int, since: float = 0.0, inc: int | None = None
    ) -> bool:
        """Whether ``group`` (incarnation ``inc``) healed before it trained, after ``since``.

        True when its first commit was a heal step (it contributed nothing), or when an earlier
        step loaded a peer's state and then failed: the counter moved without a commit, which
        only a heal does.
        """
        for e in events:
            if e["kind"] != "step" or e["group"] != group or e["time"] <= since:
                continue
            if inc is not None and e["inc"] != inc:
                continue
            if e["committed"]:
                return not e["reduce"]["participating"]
            if e["after"] != e["before"]:
                return True
        return False

    def top_step(self) -> int:
        with self._cond:
            return max((e["after"] for e in self.commits(self.events)), default=0)

    # -- the end ------------------------------------------------------------------------------

    def finish(
        self, margin: int = 100, timeout_s: float = 60.0
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Lets every group stop at a common step and returns each group's final weights.

        The target is ``margin`` steps past the highest step seen, so no group has reached it
        when the file appears (steps take ~10 ms: this leaves a second for the events to reach
        us; a group that finds the target already passed exits with an error, loudly); the
        workers then stop at the first full commit at or past it. Every rank's weights are kept
        in ``final``; rank 0's are returned.
        """
        target = self.top_step() + margin
        tmp = self.target_file.with_suffix(".tmp")
        tmp.write_text(str(target))
        tmp.replace(self.target_file)
        current = [r for procs in self.procs.values() for r in procs[-1].ranks()]
        self.wait_for(
            f"every group to stop at a full commit >= step {target}",
            lambda events: all(p.popen.poll() == 0 for p in current),
            timeout_s,
        )
        for p in current:
            assert p.reader is not None
            p.reader.join(timeout=10)
        self.final = {(p.group, p.rank): torch.load(p.out, weights_only=True) for p in current}
        return {group: state for (group, rank), state in self.final.items() if rank == 0}

    def close(self) -> None:
        """Ends every process this job started that is still running (by its pid).

        With ``FAILFAST_EVENTS=DIR`` set, the events are also written to ``DIR`` (a timeline
        to look at when a test is slow or fails).
        """
        keep = os.environ.get("FAILFAST_EVENTS")
        if keep:
            name = f"events-{os.getpid()}-{time.time():.0f}.json"
            Path(keep, name).write_text(json.dumps(self.events + self.rank_events))
        for p in self.all_procs():
            if p.popen.poll() is None:
                p.popen.kill()  # a stopped process dies of SIGKILL too
                p.popen.wait(timeout=30)
            if p.reader is not None:
                p.reader.join(timeout=10)
            if p.popen.stdin is not None:
                p.popen.stdin.close()
            if p.popen.stdout is not None:
                p.popen.stdout.close()
        self._stores.clear()
