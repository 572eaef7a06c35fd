"""Chaos soak: random faults on a running job, then proof that nothing was lost.

    python bench/chaos.py [--duration 600] [--seed N] [--compute-s 0.02] [--keep DIR]
        [--flip-every S]

A lighthouse at the reference's defaults (``min_replicas=1``, heartbeat timeout 5 s, join
timeout 100 ms) and 3 replica groups of 2 ranks each (``_chaos_worker.py``, started torchrun-like
by ``torchheal.launcher.group.GroupStart``: a fresh store per start). Each group reaches the
lighthouse through a proxy of its own (``_chaos_proxy.py``). Every 5-15 s one group that is not
already under a fault gets one, the kinds taken in turn in a shuffled order:

* ``kill``: one of its ranks is SIGKILLed; as torchrun would, the bench ends the group's other
  rank and starts the group again (after 1 s); it heals from a peer;
* ``stop``: every rank is SIGSTOPped for 2-8 s, then SIGCONTed (below and above the heartbeat
  timeout);
* ``cut``: its path to the lighthouse stalls for 6-10 s (longer than the heartbeat timeout), then
  moves again: a partition of the control plane, with no FIN or RST.

With ``--flip-every S``, every S seconds one bit of one parameter of one rank of one group
flips (``_chaos_flips.py``: chosen by an rng of the seed; the worker applies it after a commit
in a full quorum), and the ranks run the divergence guard every step under ``repair``; no other
fault is injected until the flipped rank reports the mismatch (or ``flip_report_s`` passes).

One group is always left alone. At the end every fault is lifted, every group must train again
in a full quorum, and all stop at a common step. Checked (``_chaos_check.py``): no process hung
or died unplanned, rank ``r`` of every group ends bit-identical, every committed step was
committed in one quorum with one divisor and the steps are 0..N-1 (a group that came back
alone to a lighthouse that saw no other may re-run steps the job had passed, in a quorum of its
own, as the reference does at ``min_replicas=1``; allowed only when no other quorum committed
meanwhile and the re-run was healed over: no split brain, nothing lost), the ranks of a group
committed the same steps, no rank's committed step ever went back. Printed: the fault table
(injected, survived, the job's longest stall and the victim's time until it trains in a full
quorum again, median / max, and data lost), with the problems if any. With flips: each flip
(when, what, the step it was applied at, when the guard reported it and the step compared),
a problem unless its rank reported it before any comparison found its state equal, naming
the tensor; and, in any soak, a mismatch the guard reports that no flip explains is a problem.
Exit code 1 on a problem.

The test suite runs a 60-second version (``tests/chaos/test_chaos.py``). Timings on a shared
2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import _chaos_flips as flips
from bench._chaos_check import (
    Event,
    Fault,
    check_history,
    check_identical,
    check_ranks_agree,
    full,
    measure,
    went_back,
)
from bench._chaos_config import ChaosConfig, ChaosResult
from bench._chaos_proxy import StallingProxy
from bench._chaos_report import table
from torchheal.coordination import LighthouseServer
from torchheal.launcher.group import GroupStart, OutputLine

WORKER = str(Path(__file__).with_name("_chaos_worker.py"))
PREFIX = "@chaos "
KINDS = ("kill", "stop", "cut")


@dataclass
class _Group:
    index: int
    proxy: StallingProxy
    start: GroupStart | None = None
    incarnation: int = 0
    fault: Fault | None = None
    restart_at: float | None = None
    done: bool = False


class Soak:
    """Runs one soak (see the module's docstring).

    Args:
        config: the soak's settings.
    """

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.workdir = config.workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.target_file = self.workdir / "target"
        self.events: list[Event] = []
        self.faults: list[Fault] = []
        self.unplanned: list[tuple[int, int, dict[int, int]]] = []
        self.lines: queue.Queue[OutputLine] = queue.Queue()
        self.groups: list[_Group] = []
        self._kinds: list[str] = []
        self.flips = flips.FlipOrders(
            config.seed, self.workdir, config.groups, config.ranks, config.flip_report_s
        )
        self._started = time.time()
        self._logs: dict[tuple[int, int, int], Any] = {}
        self._events_file = open(self.workdir / "events.jsonl", "a")  # closed at the end of run()

    # -- processes ------------------------------------------------------------------------------

    def _start(self, g: _Group, lighthouse_url: str) -> None:
        g.incarnation += 1
        host = g.proxy.host
        g.start = GroupStart(
            group=g.index,
            incarnation=g.incarnation,
            command=[
                sys.executable,
                WORKER,
                "--target-file",
                str(self.target_file),
                "--out-dir",
                str(self.workdir),
                "--timeout",
                str(self.config.timeout_s),
                "--compute-s",
                str(self.config.compute_s),
                *(("--flip-dir", str(self.workdir)) if self.config.flip_every_s else ()),
            ],
            nproc=self.config.ranks,
            replicas=self.config.groups,
            lighthouse=f"http://{host}:{lighthouse_url.rsplit(':', 1)[1]}",
            base_env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "LOGLEVEL": self.config.log_level,
                **self.config.guard_env(),
            },
            lines=self.lines,
            run_id=f"chaos-{self.config.seed}",
        )
        g.restart_at = None

    def _drain(self) -> None:
        import json

        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            key = (line.group, line.incarnation, line.rank)
            if line.text is None:
                continue
            if line.text.startswith(PREFIX):
                event = json.loads(line.text[len(PREFIX) :])
                event.update(group=line.group, inc=line.incarnation, rank=line.rank)
                self.events.append(event)
                self.flips.track(event)
                self._events_file.write(json.dumps(event) + "\n")
                continue
            log = self._logs.get(key)
            if log is None:
                log = self._logs[key] = open(self.workdir / f"g{key[0]}i{key[1]}r{key[2]}.log", "a")
            log.write(line.text + "\n")

    def _reap_dead(self, now: float) -> None:
        for g in self.groups:
            start = g.start
            if start is None or g.done or len(start.running()) == len(start.procs):
                continue
            codes = {r: p.poll() for r, p in enumerate(start.procs)}
            if all(c == 0 for c in codes.values()):
                g.done = True
                continue
            if any(c not in (None, 0) for c in codes.values()) or not self._stopping:
                planned = g.fault is not None and g.fault.kind == "kill"
                start.kill()
                start.reap()
                start.close()
                if not planned:
                    self.unplanned.append((g.index, g.incarnation, dict(start.exit_codes)))
                g.start = None
                g.restart_at = now + self.config.restart_delay_s

    # -- faults ---------------------------------------------------------------------------------

    def _next_kind(self) -> str:
        if not self._kinds:
            self._kinds = list(KINDS)
            self.rng.shuffle(self._kinds)
        return self._kinds.pop()

    def _inject(self, now: float) -> None:
        free = [g for g in self.groups if g.fault is None and g.start is not None]
        busy = len(self.groups) - len(free)
        if len(free) < 2 or busy + 1 >= len(self.groups):
            return  # one group always stays untouched
        g = self.rng.choice(free)
        kind = self._next_kind()
        fault = Fault(kind, g.index, time.time())
        assert g.start is not None
        if kind == "kill":
            rank = self.rng.randrange(len(g.start.procs))
            fault.detail = f"rank {rank}"
            g.start.procs[rank].send_signal(signal.SIGKILL)
            fault_end = None
        elif kind == "stop":
            hold = self.rng.uniform(*self.config.stop_s)
            fault.detail = f"{hold:.1f}s"
            for p in g.start.procs:
                p.send_signal(signal.SIGSTOP)
            fault_end = now + hold
        else:
            hold = self.rng.uniform(*self.config.cut_s)
            fault.detail = f"{hold:.1f}s"
            g.proxy.stall()
            fault_end = now + hold
        fault.notes.append(f"lift at {fault_end}")
        g.fault = fault
        self.faults.append(fault)
        self._lift_at[g.index] = fault_end

    def _lift(self, g: _Group) -> None:
        fault = g.fault
        assert fault is not None
        if fault.kind == "stop" and g.start is not None:
            for p in g.start.procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
        elif fault.kind == "cut":
            g.proxy.resume()
        fault.end = time.time()
        fault.notes.clear()
        g.fault = None
        self._lift_at[g.index] = None

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> ChaosResult:
        """Runs the soak and checks it."""
        cfg = self.config
        self._stopping = False
        self._lift_at: dict[int, float | None] = {}
        problems: list[str] = []
        log = self._lighthouse_log()
        server = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=100,
            heartbeat_timeout_ms=cfg.heartbeat_timeout_ms,
        )
        url = self._url = f"http://127.0.0.1:{server.port()}"
        ports = [server.port(), server.direct_port()]
        try:
            for i in range(cfg.groups):
                proxy = StallingProxy(f"127.0.0.{11 + i}", "127.0.0.1", ports)
                self.groups.append(_Group(i, proxy))
            for g in self.groups:
                self._start(g, url)
            problems += self._wait_together("the job to start", cfg.settle_s, since=0.0)
            t_end = time.time() + cfg.duration_s
            self._started = time.time()
            next_fault = time.time() + self.rng.uniform(*cfg.gap_s)
            next_flip = time.time() + (cfg.flip_every_s or 0.0)
            while time.time() < t_end and not problems:
                self._tick(url)
                now = time.time()
                # No fault while a flip awaits its report: a heal could erase the flip, and
                # nothing else may explain a mismatch.
                if now >= next_fault and self.flips.pending is None:
                    self._inject(time.monotonic())
                    next_fault = now + self.rng.uniform(*cfg.gap_s)
                if cfg.flip_every_s and now >= next_flip and self._order_flip():
                    next_flip = now + cfg.flip_every_s
                time.sleep(0.05)
            # The end: lift every fault, let every group train together, stop together.
            for g in self.groups:
                if g.fault is not None and g.fault.kind != "kill":
                    self._lift(g)
            lifted = time.time()
            problems += self._wait_together(
                "every group to train in a full quorum after the last fault",
                cfg.settle_s,
                since=lifted,
            )
            if not problems:
                problems += self._finish()
        finally:
            self._close()
            server.shutdown()
            root = logging.getLogger("torchheal")
            root.removeHandler(log)
            root.setLevel(self._log_level_before)
            log.close()
        self._drain()
        self._events_file.close()
        states = self._states() if not problems else {}
        steps, history_problems = check_history(self.events)
        problems += history_problems
        done = {(g.index, g.incarnation) for g in self.groups if g.done}
        problems += check_ranks_agree(self.events, done)
        for t, n, who in went_back(self.events):
            problems.append(f"{who}'s committed step went back by {n} at {t:.1f}")
        for g, inc, codes in self.unplanned:
            problems.append(f"g{g} start {inc} died unplanned: exit codes {codes}")
        differ = check_identical(states)
        problems += differ
        measure(self.faults, self.events, cfg.groups)
        if cfg.flip_every_s:
            problems += flips.match(self.flips.flips, self.events)
        problems += flips.unexplained(self.flips.flips, self.events)
        return ChaosResult(
            self.faults,
            self.events,
            steps,
            problems,
            self.unplanned,
            flips=self.flips.flips,
            started=self._started,
            identical=not differ if states else None,
        )

    def _order_flip(self) -> bool:
        """Orders the next flip if no fault or flip is under way; says whether it did."""
        if self.flips.pending is not None or any(
            g.fault is not None or g.start is None for g in self.groups
        ):
            return False
        self.flips.order_next(time.time(), time.monotonic())
        return True

    def _lighthouse_log(self) -> logging.Handler:
        """Sends the in-process lighthouse's lines (this process runs nothing else of
        torchheal) to ``lighthouse.log`` at the configured level."""
        handler = logging.FileHandler(self.workdir / "lighthouse.log")
        handler.setLevel(self.config.log_level)
        fmt = "%(created).3f %(levelname).1s %(name)s %(message)s"
        handler.setFormatter(logging.Formatter(fmt))
        root = logging.getLogger("torchheal")
        root.addHandler(handler)
        self._log_level_before = root.level
        if root.getEffectiveLevel() > handler.level:
            root.setLevel(handler.level)
        return handler

    def _tick(self, url: str) -> None:
        self._drain()
        self.flips.expire(time.monotonic())
        now = time.monotonic()
        self._reap_dead(time.monotonic())
        for g in self.groups:
            lift = self._lift_at.get(g.index)
            if g.fault is not None and lift is not None and now >= lift:
                self._lift(g)
            if g.start is None and g.restart_at is not None and now >= g.restart_at:
                self._start(g, url)
                if g.fault is not None and g.fault.kind == "kill":
                    self._lift(g)

    def _wait_together(self, what: str, bound_s: float, since: float) -> list[str]:
        """Waits until each group's current start made 3 full commits after ``since``."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            self._tick(self._url)
            settled = self.flips.pending is None  # a flip ordered last is reported before the end
            if settled and all(self._full_commits(g, since) >= 3 for g in self.groups):
                return []
            time.sleep(0.1)
        return [f"hung: timed out after {bound_s:.0f}s waiting for {what}; " + self._describe()]

    def _full_commits(self, g: _Group, since: float) -> int:
        return sum(
            1
            for e in self.events
            if e["kind"] == "step"
            and e["group"] == g.index
            and e["inc"] == g.incarnation
            and e["time"] > since
            and full(e, self.config.groups)
        )

    def _finish(self) -> list[str]:
        """Stops every group at a common full commit; returns problems."""
        recent = [e for e in self.events if e["kind"] == "step" and e["committed"]]
        top = max(e["after"] for e in recent)
        span = recent[-1]["time"] - recent[max(0, len(recent) - 200)]["time"]
        rate = 200 / max(span, 1e-3) / (self.config.groups * self.config.ranks)
        target = top + max(50, int(rate * 5))
        tmp = self.target_file.with_suffix(".tmp")
        tmp.write_text(str(target))
        tmp.replace(self.target_file)
        self._stopping = True
        deadline = time.monotonic() + self.config.settle_s
        while time.monotonic() < deadline:
            self._tick(self._url)
            if all(g.done for g in self.groups):
                return []
            time.sleep(0.1)
        return [f"hung: not every group stopped at step >= {target}; " + self._describe()]

    def _describe(self) -> str:
        parts = []
        for g in self.groups:
            mine = [e for e in self.events if e["group"] == g.index and e["inc"] == g.incarnation]
            running = None if g.start is None else g.start.running()
            parts.append(
                f"g{g.index} start {g.incarnation} running={running} done={g.done} "
                f"fault={g.fault} last={mine[-2:]}"
            )
        return " | ".join(parts)

    def _states(self) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        out = {}
        for g in range(self.config.groups):
            for r in range(self.config.ranks):
                out[(g, r)] = torch.load(self.workdir / f"g{g}r{r}.pt", weights_only=True)
        return out

    def _close(self) -> None:
        for g in self.groups:
            if g.start is not None:
                for p in g.start.procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGCONT)  # a stopped process must see its end
                g.start.kill()
                g.start.reap()
                g.start.close()
            g.proxy.close()
        for log in self._logs.values():
            log.close()


def run_soak(config: ChaosConfig) -> ChaosResult:
    """Runs one soak (see the module's docstring) and returns what it found.

    Args:
        config: the soak's settings.
    """
    soak = Soak(config)
    return soak.run()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    p.add_argument("--seed", type=int, default=None, help="the faults' seed (default: random)")
    p.add_argument("--compute-s", type=float, default=0.02, help="sleep per step (accelerator)")
    p.add_argument("--keep", type=Path, default=None, help="directory for logs and states")
    p.add_argument("--faults", action="store_true", help="also list every fault")
    p.add_argument(
        "--flip-every",
        type=float,
        default=None,
        metavar="S",
        help="flip one bit of one parameter of one rank every S seconds; the divergence guard "
        "(every step, repair) must report each (default: no flips)",
    )
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    config = ChaosConfig(
        duration_s=args.duration,
        seed=seed,
        compute_s=args.compute_s,
        flip_every_s=args.flip_every,
    )
    if args.keep is not None:
        config.workdir = args.keep
    print(f"chaos soak: {args.duration:.0f}s, seed {seed}, logs in {config.workdir}", flush=True)
    result = run_soak(config)
    if args.faults:
        for f in result.faults:
            print(
                f"  {f.kind:4} g{f.group} {f.detail:>6}  stall {f.job_stall_s}  back {f.back_s}"
                f"  lost {f.data_lost} {' '.join(f.notes)}"
            )
    print(table(result))
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
