"""Goodput: how much training a job keeps while replica groups keep dying (issue 9's headline).

Three replica groups (1 rank each, its own process and TCPStore, Gloo) train an MLP of ~6.3M
parameters (1024-2048-1536-512) with AdamW, batch 32, one torch thread, under fault-tolerant DDP
at ``min_replica_size=1``, against a lighthouse in its own process (the CLI) at the reference's
defaults: ``min_replicas=1``, join timeout 100 ms, tick 100 ms, heartbeat timeout 5 s.

Once every group has committed in one quorum (plus ``--warmup`` seconds), the job trains
``--healthy`` seconds without failures, then ``--failing`` seconds during which a random non-zero
group is SIGKILLed every ``--kill-every`` seconds (first kill at the start of that phase) and
started again ``--restart-delay`` seconds later. The same run is done with the reference
(torchft managers and the torchft lighthouse) when it is installed, with the same victims.

Restarts (``--restart``): ``warm`` (the default) starts a killed group in a warm spare, the
mechanism of ``torchheal launch --warm-spares``: a process started ahead of time that has
imported torch (its compiler stack too) and the library, handed the group's argv and environment
when it is needed (``torchheal/launcher/spare.py``); the reference's spare imports torchft's
modules instead of torchheal's, so both libraries restart the same way. ``cold`` starts an
ordinary process (interpreter, imports and all); ``both`` does one run of each. Every row says
which it used, and each kill whether the restart did begin in a spare. ``--spares`` says how the
pool makes its spares: forked from one template that imported once (the default, as ``torchheal
launch`` does on Linux), or each a fresh interpreter that imports torch again after every kill,
seconds of CPU taken from the groups still training.

Reported, failures phase over healthy phase:

* job steps/s: distinct committed step numbers (a step counts once, whoever committed it);
* commits/s: every group's commits;
* the longest job stall in each phase: the longest gap between consecutive new job steps.

And per kill: the survivors' longest gap between two of their own commits from the kill until the
next kill (or the end), split into the gap around the kill and the longest gap while the restarted
group joins (from its Manager's construction to its third commit); the restarted group's kill ->
first commit, restart (process start, or hand-over to a spare) -> first commit, its start-up
(interpreter, torch and library imports, model and optimizer built: paid by both libraries, its
own column; in a warm spare, from the hand-over to model and optimizer built), the Manager's
construction, and Manager constructed -> first commit. Last, what each kill cost, against the pace
of the ``LOSS_WINDOW_S`` (5 s) just before it: the job time lost in the 5 s after it, and every
group's lost commit time summed; and the two ratios computed from those losses alone (1 - lost /
failing seconds). Two phases a minute apart differ by up to 5% on this shared machine with no
kill at all (``--control``); the losses, measured in the seconds around each kill, do not move
with that drift.

Goals (issue 9): job steps >= 0.99, commits >= 0.97, no survivor gap over 0.5 s.

    python -m bench.goodput                      # ~5 min on 2 cores with the reference
    python -m bench.goodput --impls torchheal --healthy 30 --failing 40 --timeline
    python -m bench.goodput --restart both       # warm and cold restarts, one run each
    python -m bench.goodput --impls torchheal,torchheal+salvage   # the step in flight salvaged

On a 2-core machine three CPU-bound groups saturate the CPU, so a dead group makes the others
faster and the ratios say more about the CPU than about fault tolerance; ``--compute-s`` adds a
sleep to each step (an accelerator's share of a real step, no CPU used) so that the CPU is not the
bottleneck. On a shared machine the load drifts between two phases a minute apart; ``--interleave``
alternates healthy and failing blocks of ``--kill-every`` seconds instead (a kill at the start of
each failing block), so drift hits both alike. ``--control`` kills nothing in the second phase: the ratios it prints are this machine's noise
floor (two failure-free phases of one run). ``--timeline`` prints, for each kill, every group's steps around it (quorum start, backward with the
allreduce and the quorum wait, optimizer step with the commit vote), which shows where a long gap
went. ``--out DIR`` keeps every event and the lighthouse's log.
"""

from __future__ import annotations

import time

T_EXEC = time.time()  # the worker's first line: interpreter start-up happens before it

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PREFIX = "@goodput "
#: Seconds before a kill that set its baseline step gap, and after it in which the loss is counted.
LOSS_WINDOW_S = 5.0
#: Issue 9's goals: job steps/s and commits/s ratios (failing / healthy), longest survivor gap.
JOB_GOAL, COMMITS_GOAL, GAP_GOAL_S = 0.99, 0.97, 0.5

# ---------------------------------------------------------------------------------------------
# Worker: one replica group


def _emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def worker(args: argparse.Namespace) -> None:
    # Started in a warm spare (torchheal.launcher.spare): its imports were done before the kill.
    _emit("exec", t=T_EXEC, warm=os.environ.get("TORCHHEAL_WARM_SPARE") == "1")
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    ft = importlib.import_module(library(args.impl))
    # The library's own (lazy) imports belong to start-up too.
    _ = (ft.Manager, ft.ProcessGroupGloo, ft.DistributedDataParallel, ft.Optimizer)
    importlib.import_module(f"{library(args.impl)}.checkpointing")
    _emit("imported")
    torch.set_num_threads(1)  # three groups share the cores
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 2048),
        nn.ReLU(),
        nn.Linear(2048, 1536),
        nn.ReLU(),
        nn.Linear(1536, 512),
    )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # The first optimizer built imports torch's compiler stack (~2 s here): start-up, as imports.
    _emit("built")
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"goodput_{args.group}",
    )
    _emit("ready")
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)
    stop = Path(args.stop_file)
    while not stop.exists():
        before = manager.current_step()
        g = torch.Generator().manual_seed(args.group * 1_000_003 + before)
        x, y = torch.randn(32, 1024, generator=g), torch.randn(32, 512, generator=g)
        t0 = time.time()
        optimizer.zero_grad()
        t1 = time.time()
        out = ddp(x)
        if args.compute_s:
            time.sleep(args.compute_s)  # an accelerator's share of the step: no CPU used
        nn.functional.mse_loss(out, y).backward()
        t2 = time.time()
        optimizer.step()
        t3 = time.time()
        after = manager.current_step()
        _emit(
            "step",
            t=t3,
            phases=[t0, t1, t2],
            before=before,
            after=after,
            committed=after > before,
            participants=manager.num_participants(),
            quorum_id=manager._quorum_id,
        )
    manager.shutdown(wait=False)
    _emit("done")
    os._exit(0)  # skip the interpreter's slow teardown (gloo and grpc threads)


# ---------------------------------------------------------------------------------------------
# Driver: processes


#: ``--impls`` name of torchheal with ``Manager(salvage_step=True)`` (torchheal's lighthouse).
SALVAGE = "torchheal+salvage"


def library(impl: str) -> str:
    """The library an ``--impls`` name runs ("torchheal+salvage" is torchheal)."""
    return impl.split("+", 1)[0]


@contextlib.contextmanager
def lighthouse_process(impl: str, log: Path) -> Iterator[str]:
    """A lighthouse of ``impl`` in its own process (its CLI), at the reference's defaults.

    Args:
        impl: "torchheal" or "torchft".
        log: where its output goes.
    """
    # Driver side only: workers run this file as a script, without the package on their path.
    from bench._procs import free_port, lighthouse_command
    from bench._procs import lighthouse_process as lighthouse_process_of

    port = free_port()
    with (
        open(log, "w") as out,
        lighthouse_process_of(
            lighthouse_command(library(impl), port),
            port,
            out,
            {**os.environ, "RUST_LOG": "info"},
        ) as addr,
    ):
        yield addr


@dataclass
class Proc:
    """One start of one group."""

    group: int
    incarnation: int
    popen: subprocess.Popen[str]
    launched: float
    log: Path


def preload(impl: str) -> list[str]:
    """What a warm spare of ``impl`` imports: torch's (the same for both libraries), then the
    library's modules the worker uses, as ``torchheal launch``'s spares do for torchheal."""
    return [
        "torch",
        "torch.distributed",
        "torch._dynamo",  # the first optimizer built imports it (~1.5 s here)
        *(f"{library(impl)}{m}" for m in ("", ".manager", ".process_group", ".ddp", ".optim")),
        f"{library(impl)}.checkpointing",
    ]


class Job:
    """The groups of one run: started, killed and restarted here, their events in one list.

    Restarts go through a :class:`~torchheal.launcher.spare.SparePool`: with ``restart="warm"``
    it keeps one spare (torch and ``impl``'s modules imported) that the next restart starts in,
    started again once every group has committed in its current start; with ``"cold"`` it
    keeps none and every start is an ordinary process, with the same pipes either way.
    """

    def __init__(
        self,
        impl: str,
        lighthouse: str,
        groups: int,
        out: Path,
        compute_s: float = 0.0,
        restart: str = "warm",
        spares: str = "forked",
    ) -> None:
        from torchheal.launcher.spare import SparePool

        self.impl = impl
        self.compute_s = compute_s
        self.lighthouse = lighthouse
        self.groups = groups
        self.out = out
        self.restart = restart
        self.stop_file = out / f"stop-{impl}-{restart}"
        self.procs: dict[int, list[Proc]] = {g: [] for g in range(groups)}
        self.events: list[dict[str, Any]] = []
        self.committed: set[tuple[int, int]] = set()  # (group, incarnation) that committed
        self.arrivals: queue.Queue[dict[str, Any]] = queue.Queue()
        self.env = {**os.environ, "LOGLEVEL": "WARNING", "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}
        # The worker's Manager reads it (salvage_step=None); any other run has it off.
        self.env["TORCHHEAL_SALVAGE_STEP"] = "1" if impl == SALVAGE else "0"
        self.pool = SparePool(
            self.command(0),
            1 if restart == "warm" else 0,
            env=self.env,
            cwd=str(ROOT),
            preload=preload(impl),
            start_new_session=True,
            fork=spares == "forked",
        )

    def command(self, group: int) -> list[str]:
        cmd = [sys.executable, "-m", "bench.goodput", "--worker", "--impl", self.impl]
        cmd += ["--group", str(group), "--lighthouse", self.lighthouse]
        return [*cmd, "--stop-file", str(self.stop_file), "--compute-s", str(self.compute_s)]

    def start(self, group: int) -> Proc:
        """Starts the group: cold the first time, then as ``restart`` says."""
        incarnation = len(self.procs[group])
        log = self.out / f"{self.impl}-{self.restart}-g{group}i{incarnation}.log"
        launched = time.time()
        spawn = self.pool.spawn if incarnation else self.pool.cold_start
        popen = spawn(self.command(group), self.env)
        proc = Proc(group, incarnation, popen, launched, log)
        self.procs[group].append(proc)
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        return proc

    def refill(self) -> None:
        """Starts a spare when none waits and every group committed in its current start."""
        if self.pool.enabled and not self.pool.pids and all(map(self.up, range(self.groups))):
            self.pool.fill()

    def _read(self, proc: Proc) -> None:
        assert proc.popen.stdout is not None
        with open(proc.log, "w") as log:
            for line in proc.popen.stdout:
                if line.startswith(PREFIX):
                    event = json.loads(line[len(PREFIX) :])
                    event.update(group=proc.group, inc=proc.incarnation)
                    self.arrivals.put(event)
                else:
                    log.write(line)
                    log.flush()

    def drain(self, timeout: float) -> None:
        """Takes in the events that arrived (waiting up to ``timeout`` for the first)."""
        try:
            event = self.arrivals.get(timeout=timeout)
            while True:
                self.events.append(event)
                if event["kind"] == "step" and event["committed"]:
                    self.committed.add((event["group"], event["inc"]))
                event = self.arrivals.get_nowait()
        except queue.Empty:
            pass

    def kill(self, group: int) -> float:
        """SIGKILLs the group's current start (its whole session); returns when."""
        proc = self.procs[group][-1]
        when = time.time()
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait()
        return when

    def up(self, group: int) -> bool:
        """Its current start runs and has committed a step."""
        proc = self.procs[group][-1]
        return proc.popen.poll() is None and (group, proc.incarnation) in self.committed

    def check_alive(self) -> None:
        for procs in self.procs.values():
            proc = procs[-1]
            if proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(
                    f"{self.impl} g{proc.group} exited with {proc.popen.returncode}:\n"
                    + "\n".join(tail)
                )

    def stop(self) -> None:
        self.stop_file.touch()
        deadline = time.time() + 60
        for procs in self.procs.values():
            for proc in procs:
                if proc.popen.poll() is None:
                    try:
                        proc.popen.wait(max(0.1, deadline - time.time()))
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.popen.pid, signal.SIGKILL)
                        proc.popen.wait()
        self.pool.close()
        self.drain(0.5)


@dataclass
class Kill:
    """One injected failure: the group, when, and the start that replaced it."""

    group: int
    at: float
    restart_inc: int | None = None
    restart_at: float | None = None


@dataclass
class RunData:
    """What one run recorded (saved as JSON with ``--out``; ``--report DIR`` prints it again)."""

    impl: str
    groups: int
    healthy: list[tuple[float, float]]  # windows without failures
    failing: list[tuple[float, float]]  # windows with failures (a kill at the start of each)
    kills: list[Kill]
    events: list[dict[str, Any]]
    kill_every: float = 0.0
    restart_delay: float = 0.0
    compute_s: float = 0.0
    restart: str = "cold"  # how restarted groups started: "warm" (a spare) or "cold"
    spares: str = "forked"  # warm spares forked from a template, or each started "fresh"

    @property
    def label(self) -> str:
        return f"{self.impl} {self.restart}"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @staticmethod
    def load(path: Path) -> RunData:
        d = json.loads(path.read_text())
        d["kills"] = [Kill(**k) for k in d["kills"]]
        d["healthy"] = [tuple(w) for w in d["healthy"]]
        d["failing"] = [tuple(w) for w in d["failing"]]
        return RunData(**d)


def schedule(
    t0: float, args: argparse.Namespace
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The healthy and failing windows from ``t0``: one of each, or alternating blocks."""
    if not args.interleave:
        return [(t0, t0 + args.healthy)], [(t0 + args.healthy, t0 + args.healthy + args.failing)]
    block = args.kill_every
    n = round(args.failing / block)
    healthy = [(t0 + 2 * i * block, t0 + (2 * i + 1) * block) for i in range(n)]
    failing = [(t0 + (2 * i + 1) * block, t0 + (2 * i + 2) * block) for i in range(n)]
    return healthy, failing


def run(
    impl: str, args: argparse.Namespace, victims: list[int], out: Path, restart: str = "warm"
) -> RunData:
    """One run of ``impl`` restarting groups ``restart``: warm-up, then the windows."""
    with lighthouse_process(impl, out / f"lighthouse-{impl}-{restart}.log") as addr:
        job = Job(impl, addr, args.groups, out, args.compute_s, restart, args.spares)
        try:
            for g in range(args.groups):
                job.start(g)
            deadline = time.time() + 300
            together: float | None = None
            while together is None:
                job.drain(0.2)
                job.check_alive()
                full = [
                    e
                    for e in job.events
                    if e["kind"] == "step" and e["committed"] and e["participants"] == args.groups
                ]
                if {e["group"] for e in full} == set(range(args.groups)):
                    together = max(e["t"] for e in full)
                if time.time() > deadline:
                    raise RuntimeError(f"{impl}: the groups never trained together")
            # The first spare imports during the warm-up, and is ready before the windows.
            job.refill()
            job.pool.wait_ready(120)
            healthy, failing = schedule(max(together, time.time()) + args.warmup, args)
            t1, t2 = failing[0][0], max(healthy[-1][1], failing[-1][1])
            kill_times = (
                []
                if args.control
                else [
                    t
                    for a, b in failing
                    for t in itertools.takewhile(
                        lambda t, b=b: t < b, itertools.count(a, args.kill_every)
                    )
                ]
            )
            kills: list[Kill] = []
            restarts: list[tuple[float, int]] = []
            pending = list(kill_times)
            victims_left = list(victims)
            while time.time() < t2:
                job.drain(0.05)
                job.refill()
                now = time.time()
                if pending and now >= pending[0]:
                    victim = victims_left[0]
                    if job.up(victim):  # else: not back from its last kill yet; kill it then
                        victims_left.pop(0)
                        pending.pop(0)
                        kills.append(Kill(victim, job.kill(victim)))
                        restarts.append((time.time() + args.restart_delay, victim))
                        print(
                            f"  [{impl} {restart}] t={now - t1:5.1f}s killed g{victim}",
                            file=sys.stderr,
                        )
                for when, group in list(restarts):
                    if now >= when:
                        restarts.remove((when, group))
                        proc = job.start(group)
                        kill = next(k for k in reversed(kills) if k.group == group)
                        kill.restart_inc, kill.restart_at = proc.incarnation, proc.launched
                for procs in job.procs.values():
                    proc = procs[-1]
                    if proc.popen.poll() is not None and not any(
                        g == proc.group for _, g in restarts
                    ):
                        job.check_alive()
        finally:
            job.stop()
    data = RunData(
        impl,
        args.groups,
        healthy,
        failing,
        kills,
        job.events,
        args.kill_every,
        args.restart_delay,
        args.compute_s,
        restart,
        args.spares,
    )
    data.save(out / f"run-{impl}-{restart}.json")
    return data


# ---------------------------------------------------------------------------------------------
# Analysis


def _commits(events: list[dict[str, Any]], group: int | None = None) -> list[dict[str, Any]]:
    return sorted(
        (
            e
            for e in events
            if e["kind"] == "step" and e["committed"] and (group is None or e["group"] == group)
        ),
        key=lambda e: e["t"],
    )


def _job_steps(events: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(time, step) of each job step's first commit, in time order."""
    first: dict[int, float] = {}
    for e in _commits(events):
        first.setdefault(e["after"], e["t"])
    return sorted((t, s) for s, t in first.items())


@dataclass
class Phase:
    job_steps_per_s: float
    commits_per_s: float
    longest_stall_s: float


def phase(events: list[dict[str, Any]], windows: list[tuple[float, float]]) -> Phase:
    """Rates over the windows together, and the longest stall in any of them."""
    job_steps = [t for t, _ in _job_steps(events)]
    commit_times = [e["t"] for e in _commits(events)]
    steps = commits = 0
    stall = 0.0
    for a, b in windows:
        inside = [t for t in job_steps if a <= t < b]
        steps += len(inside)
        commits += sum(1 for t in commit_times if a <= t < b)
        stall = max([stall] + [y - x for x, y in itertools.pairwise([a, *inside, b])])
    seconds = sum(b - a for a, b in windows)
    return Phase(steps / seconds, commits / seconds, stall)


@dataclass
class KillCost:
    group: int
    at_s: float  # from the start of the first failing window
    survivor_max_gap_s: float | None
    gap_at_kill_s: float | None
    gap_at_rejoin_s: float | None
    kill_to_commit_s: float | None
    restart_to_commit_s: float | None
    startup_s: float | None
    gap_in_startup_s: float | None  # longest, within the restarted process's start-up
    gap_outside_startup_s: float | None  # longest of the others
    construct_s: float | None
    ready_to_commit_s: float | None
    healed: bool
    worst: tuple[int, float, float] | None = None  # survivor, gap start, gap end
    warm: bool | None = None  # the restart began in a warm spare
    job_lost_s: float | None = None  # job time the kill cost against the gaps just before it
    group_lost_s: float | None = None  # the same summed over every group's commits


def kill_costs(data: RunData) -> list[KillCost]:
    out = []
    for n, kill in enumerate(data.kills):
        # Until the next kill, or the end of the failing window the kill is in.
        window_end = next(b for a, b in data.failing if a <= kill.at < b + 1.0)
        end = min([window_end] + [k.at for k in data.kills[n + 1 :]])
        mine = [e for e in data.events if e["group"] == kill.group and e["inc"] == kill.restart_inc]
        launched = kill.restart_at
        first = next((e for e in mine if e["kind"] == "step" and e["committed"]), None)
        third = [e for e in mine if e["kind"] == "step" and e["committed"]][2:3]
        ready = next((e for e in mine if e["kind"] == "ready"), None)
        built = next((e for e in mine if e["kind"] == "built"), None)
        began = next((e for e in mine if e["kind"] == "exec"), None)
        rejoin = (ready["t"], third[0]["t"]) if ready and third else None
        starting = (launched, built["t"]) if launched and built else None
        in_startup: float | None = None
        outside: float | None = None
        best: tuple[float, int, float, float] | None = None
        at_kill: float | None = None
        at_rejoin: float | None = None
        for g in range(data.groups):
            if g == kill.group:
                continue
            times = [e["t"] for e in _commits(data.events, g)]
            before = [t for t in times if t <= kill.at]
            inside = [t for t in times if kill.at < t <= end]
            if not inside:
                continue
            series = before[-1:] + inside
            for x, y in itertools.pairwise(series):
                gap = y - x
                if best is None or gap > best[0]:
                    best = (gap, g, x, y)
                if x <= kill.at < y:
                    at_kill = max(at_kill or 0.0, gap)
                if rejoin is not None and y > rejoin[0] and x < rejoin[1]:
                    at_rejoin = max(at_rejoin or 0.0, gap)
                if starting is not None and starting[0] <= x and y <= starting[1]:
                    in_startup = max(in_startup or 0.0, gap)
                else:
                    outside = max(outside or 0.0, gap)
        out.append(
            KillCost(
                group=kill.group,
                at_s=kill.at - data.failing[0][0],
                survivor_max_gap_s=best[0] if best else None,
                gap_at_kill_s=at_kill,
                gap_at_rejoin_s=at_rejoin,
                kill_to_commit_s=(first["t"] - kill.at) if first else None,
                restart_to_commit_s=(first["t"] - launched) if first and launched else None,
                startup_s=(built["t"] - launched) if built and launched else None,
                gap_in_startup_s=in_startup,
                gap_outside_startup_s=outside,
                construct_s=(ready["t"] - built["t"]) if ready and built else None,
                ready_to_commit_s=(first["t"] - ready["t"]) if first and ready else None,
                healed=bool(first and first["after"] > first["before"] + 1),
                worst=(best[1], best[2], best[3]) if best else None,
                warm=began.get("warm", False) if began else None,
                job_lost_s=_lost([t for t, _ in _job_steps(data.events)], kill.at, end),
                group_lost_s=_group_lost(data, kill.at, end),
            )
        )
    return out


def _lost(times: list[float], at: float, end: float) -> float | None:
    """Time lost after ``at`` by a series of commit ``times``, against its pace just before.

    The pace is the mean gap of the commits in the :data:`LOSS_WINDOW_S` before ``at``; the
    loss is how much longer than that pace the series took, from its last commit before ``at``
    to its last one within ``LOSS_WINDOW_S`` after (or before ``end``); a series with no commit
    in that window (a victim still restarting) lost all of it. Measured against the seconds
    just before the kill, not against a healthy phase a minute away, it does not move with the
    load's drift between phases. Negative when the steps after went faster.
    """
    horizon = min(at + LOSS_WINDOW_S, end)
    before = [t for t in times if at - LOSS_WINDOW_S <= t <= at]
    after = [t for t in times if at < t <= horizon]
    if len(before) < 3:
        return None
    pace = (before[-1] - before[0]) / (len(before) - 1)
    return ((after[-1] if after else horizon) - before[-1]) - len(after) * pace


def _group_lost(data: RunData, at: float, end: float) -> float | None:
    """:func:`_lost` of each group's commits (the victim's own and its restart's), summed.

    A group with too few commits just before the kill to have a pace (it was not training: the
    reference's groups at ``min_replicas=1`` often are not all in the quorum) is left out; None
    when no group had one.
    """
    losses = [
        _lost([e["t"] for e in _commits(data.events, g)], at, end) for g in range(data.groups)
    ]
    known = [x for x in losses if x is not None]
    return sum(known) if known else None


def _verdict(name: str, value: float, met: bool, fmt: str = ".4f", unit: str = "") -> str:
    """``name value[unit] met`` (or ``NOT met``), one goal's line."""
    return f"{name} {value:{fmt}}{unit} {'met' if met else 'NOT met'}"


def attributable(data: RunData, costs: list[KillCost]) -> str:
    """Job-steps and commits ratios from the kills' measured losses alone (see :func:`_lost`).

    Args:
        data: one run.
        costs: its :func:`kill_costs`.
    """
    if not costs:
        return "no kills"
    job, groups = 0.0, 0.0
    for c in costs:
        if c.job_lost_s is None or c.group_lost_s is None:
            return "n/a (a kill without its windows)"
        job += c.job_lost_s
        groups += c.group_lost_s
    failing_s = sum(b - a for a, b in data.failing)
    jr, cr = 1 - job / failing_s, 1 - groups / (data.groups * failing_s)
    return (
        f"{_verdict('job steps', jr, jr >= JOB_GOAL)}; "
        f"{_verdict('commits', cr, cr >= COMMITS_GOAL)}"
    )


def normal_gap(data: RunData) -> float:
    """The median gap between a group's commits in the healthy windows."""
    gaps = [
        y - x
        for a, b in data.healthy
        for g in range(data.groups)
        for x, y in itertools.pairwise(
            [e["t"] for e in _commits(data.events, g) if a <= e["t"] < b]
        )
    ]
    return statistics.median(gaps) if gaps else float("nan")


def print_timeline(data: RunData, costs: list[KillCost]) -> None:
    """Every group's steps around each kill: where the survivors' longest gap went."""
    t1 = data.failing[0][0]
    for n, (kill, cost) in enumerate(zip(data.kills, costs, strict=True)):
        print(
            f"\n{data.impl} kill {n + 1}: g{kill.group} at {kill.at - t1:.2f}s "
            "(times in ms from the kill; quorum = zero_grad/start_quorum, "
            "backward = forward+backward with the allreduce, commit = optimizer step + vote)"
        )
        lo = kill.at - 0.5
        hi = kill.at + 1.5
        if cost.worst is not None:
            lo = min(lo, cost.worst[1] - 0.3)
            hi = max(hi, cost.worst[2] + 0.3)
        rows = []
        for e in data.events:
            if e["kind"] in ("exec", "imported", "built", "ready") and lo <= e["t"] <= hi:
                rows.append((e["t"], f"g{e['group']}i{e['inc']} {e['kind']}"))
            if e["kind"] == "step" and lo <= e["t"] <= hi:
                s, q, b = e["phases"]
                rows.append(
                    (
                        e["t"],
                        f"g{e['group']}i{e['inc']} step {e['before']}->{e['after']} "
                        f"{'commit' if e['committed'] else 'FAILED'} p={e['participants']} "
                        f"q={e['quorum_id']} quorum {1000 * (q - s):.0f} backward "
                        f"{1000 * (b - q):.0f} commit {1000 * (e['t'] - b):.0f}",
                    )
                )
        for t, what in sorted(rows):
            print(f"  {1000 * (t - kill.at):8.0f}  {what}")


# ---------------------------------------------------------------------------------------------
# Report


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(results: list[RunData], timeline: bool = False) -> None:
    """Prints the tables (and with ``timeline`` each kill's timeline)."""
    d0 = results[0]
    healthy_s = sum(b - a for a, b in d0.healthy)
    failing_s = sum(b - a for a, b in d0.failing)
    layout = (
        "then" if len(d0.failing) == 1 else f"interleaved in {len(d0.failing)} blocks of each with"
    )
    print(
        f"\ngoodput: {d0.groups} groups x 1 rank, Gloo, ~6.3M-parameter MLP + AdamW; lighthouse "
        "process at min_replicas=1, join 100 ms, tick 100 ms, heartbeat timeout 5 s; "
        f"{healthy_s:.0f} s healthy, {layout} "
        + (
            f"{failing_s:.0f} s with a SIGKILL every {d0.kill_every:.0f} s "
            f"(restart after {d0.restart_delay:.1f} s)"
            if d0.kills
            else f"{failing_s:.0f} s more without any (control run)"
        )
        + (f"; {d0.compute_s:.2f} s of simulated accelerator time per step" if d0.compute_s else "")
        + (
            f"; warm spares {'forked from a template' if d0.spares == 'forked' else 'started fresh'}"
            if any(r.restart == "warm" for r in results)
            else ""
        )
    )
    head = (
        f"{'impl restart':<16}{'job steps/s':>12}{'':>9}{'ratio':>7}{'commits/s':>11}{'':>9}{'ratio':>7}"
        f"{'longest job stall s':>21}{'normal gap':>12}"
    )
    print(head)
    print(
        f"{'':<16}{'healthy':>12}{'failing':>9}{'':>7}{'healthy':>11}{'failing':>9}{'':>7}"
        f"{'healthy / failing':>21}{'s':>12}"
    )
    verdicts = []
    costs_of = [kill_costs(d) for d in results]
    for d, costs in zip(results, costs_of, strict=True):
        h, f = phase(d.events, d.healthy), phase(d.events, d.failing)
        jr = f.job_steps_per_s / h.job_steps_per_s if h.job_steps_per_s else float("nan")
        cr = f.commits_per_s / h.commits_per_s if h.commits_per_s else float("nan")
        worst = max((c.survivor_max_gap_s or 0.0 for c in costs), default=0.0)
        outside = max((c.gap_outside_startup_s or 0.0 for c in costs), default=0.0)
        print(
            f"{d.label:<16}{h.job_steps_per_s:>12.2f}{f.job_steps_per_s:>9.2f}{jr:>7.3f}"
            f"{h.commits_per_s:>11.2f}{f.commits_per_s:>9.2f}{cr:>7.3f}"
            f"{h.longest_stall_s:>12.2f} / {f.longest_stall_s:<6.2f}{normal_gap(d):>12.3f}"
        )
        verdicts.append((d.label, jr, cr, worst, outside))
    print(
        "\nper kill (s). Survivors' longest gap between two of their commits from the kill to the "
        "next kill: overall, around the kill, within the restarted process's start-up "
        "(interpreter, imports, model and optimizer: no library code runs yet, its CPU and disk "
        "are taken from the survivors), while the restarted group joins (Manager constructed to "
        "its third commit), and the longest outside its start-up. The restarted group: kill -> "
        "first commit, restart -> first commit, its start-up (paid by both libraries: from the "
        "process start, or in a warm spare from the hand-over, to model and optimizer built), "
        "its Manager's construction, Manager constructed -> first commit, and whether it began "
        "in a warm spare (a warm run falls back to a cold start when no spare is alive). Lost: "
        f"the time the kill cost in the {LOSS_WINDOW_S:.0f} s after it, against the pace of the "
        f"{LOSS_WINDOW_S:.0f} s before it: the job's steps, and every group's commits summed "
        "(group-seconds)."
    )
    print(
        f"{'':<35}{'survivors':-^45}{'':1}{'restarted group':-^61}"
        f"\n{'impl restart':<16}{'kill':>5}{'victim':>7}{'at s':>7}{'max':>7}{'at kill':>9}"
        f"{'start-up':>10}{'rejoin':>8}{'others':>8}  {'kill->1st':>10}{'restart->1st':>13}"
        f"{'start-up':>9}{'Manager()':>10}{'ready->1st':>11}{'healed':>7}{'spare':>6}"
        f"{'lost: job':>11}{'groups':>8}"
    )
    for d, costs in zip(results, costs_of, strict=True):
        for n, c in enumerate(costs):
            print(
                f"{d.label:<16}{n + 1:>5}{'g' + str(c.group):>7}{c.at_s:>7.1f}"
                f"{_f(c.survivor_max_gap_s):>7}{_f(c.gap_at_kill_s):>9}"
                f"{_f(c.gap_in_startup_s):>10}{_f(c.gap_at_rejoin_s):>8}"
                f"{_f(c.gap_outside_startup_s):>8}  "
                f"{_f(c.kill_to_commit_s):>10}{_f(c.restart_to_commit_s):>13}{_f(c.startup_s):>9}"
                f"{_f(c.construct_s):>10}{_f(c.ready_to_commit_s):>11}"
                f"{'yes' if c.healed else 'no':>7}"
                f"{'-' if c.warm is None else 'yes' if c.warm else 'no':>6}"
                f"{_f(c.job_lost_s):>11}{_f(c.group_lost_s):>8}"
            )
    print(
        f"\ngoals: job steps >= {JOB_GOAL}, commits >= {COMMITS_GOAL}, "
        f"no survivor gap over {GAP_GOAL_S} s"
    )
    for impl, jr, cr, worst, outside in verdicts:
        print(
            f"{impl:<16} {_verdict('job steps', jr, jr >= JOB_GOAL)}; "
            f"{_verdict('commits', cr, cr >= COMMITS_GOAL)}; "
            f"{_verdict('survivor gap', worst, worst <= GAP_GOAL_S, '.2f', ' s')} "
            f"({outside:.2f} s outside restarts' start-up)"
        )
    print(
        "\nthe same ratios from the kills' own cost (the lost columns: 1 - lost / failing "
        "seconds), which the drift of this machine's load between phases does not move:"
    )
    for d, costs in zip(results, costs_of, strict=True):
        print(f"{d.label:<16} {attributable(d, costs)}")
    if timeline:
        for d, costs in zip(results, costs_of, strict=True):
            print_timeline(d, costs)


def reference_available() -> bool:
    try:
        importlib.import_module("torchft.coordination")
    except Exception:
        return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="torchheal", help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--impls",
        default=None,
        help="comma-separated: torchheal, torchheal+salvage (Manager(salvage_step=True)), "
        "torchft (default: torchheal, and torchft if installed)",
    )
    p.add_argument("--groups", type=int, default=3)
    p.add_argument(
        "--warmup", type=float, default=5.0, help="s after the groups first train together"
    )
    p.add_argument("--healthy", type=float, default=60.0, help="s without failures")
    p.add_argument("--failing", type=float, default=60.0, help="s with failures")
    p.add_argument("--kill-every", type=float, default=20.0)
    p.add_argument("--restart-delay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="of the random victims")
    p.add_argument(
        "--compute-s",
        type=float,
        default=0.0,
        help="seconds each step sleeps after forward, standing for an accelerator's share of the "
        "step (on 2 cores, 3 CPU-bound groups saturate the machine: a dead group frees CPU)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="alternate healthy and failing blocks of --kill-every seconds (load drift on a "
        "shared machine then hits both alike)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="no kills in the second phase: how far two failure-free phases differ here",
    )
    p.add_argument(
        "--restart",
        choices=("warm", "cold", "both"),
        default="warm",
        help="how killed groups start again: in a warm spare that already imported torch and "
        "the library (torchheal.launcher.spare, the same for both libraries), as an ordinary "
        "process, or one run of each (default %(default)s)",
    )
    p.add_argument(
        "--spares",
        choices=("forked", "fresh"),
        default="forked",
        help="warm spares forked from one template that imported once (torchheal launch's way "
        "on Linux), or each started as a fresh interpreter that imports again: a refill then "
        "takes seconds of CPU from the groups training (default %(default)s)",
    )
    p.add_argument("--timeline", action="store_true", help="print each kill's timeline")
    p.add_argument("--out", default=None, help="keep events and logs here")
    p.add_argument("--report", default=None, help="print the tables of the runs kept in DIR")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.report:
        runs = sorted(Path(args.report).glob("run-*.json"), reverse=True)  # torchheal first
        report([RunData.load(r) for r in runs], args.timeline)
        return
    impls = (
        args.impls.split(",")
        if args.impls
        else ["torchheal"] + (["torchft"] if reference_available() else [])
    )
    rng = random.Random(args.seed)
    kills = int(args.failing // args.kill_every) + 1
    victims = [rng.randrange(1, args.groups) for _ in range(kills)]
    print(f"load average before: {os.getloadavg()}", flush=True)
    out_ctx = contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory()
    with out_ctx as out:
        Path(out).mkdir(parents=True, exist_ok=True)
        modes = ["warm", "cold"] if args.restart == "both" else [args.restart]
        results, failed = [], []
        for impl in impls:
            for mode in modes:
                try:
                    results.append(run(impl, args, victims, Path(out), mode))
                except RuntimeError as e:  # one library's run must not lose the others' rows
                    failed.append(f"{impl} {mode}: {e}")
    report(results, args.timeline)
    for line in failed:
        print(f"not measured: {line}")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
