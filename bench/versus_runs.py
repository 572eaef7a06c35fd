"""Running each way of ``bench/versus.py`` to N steps on one failure trace, and what it recorded.

A trace is a list of (seconds after the job's first commit, victim rank). Each way applies it to
its own clock: at each time it SIGKILLs the victim's current process. A failure whose victim is not
back yet from the last one (still restarting) is applied as soon as it is, so a way that spends
longer down does not dodge failures; a way that runs longer meets more of them, as on a cluster.

* ``ckpt``: ``torchrun --max-restarts`` over all ranks of stock DDP, a DCP save every K steps; a
  dead rank makes torchrun's agent stop every rank and start them all again, from the newest save.
* ``torchheal``/``torchft``: one process per replica group (``bench.goodput.Job``: its warm-spare
  pool, its pipes), restarted alone right after its kill, cold or in a warm spare.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.goodput import Job, lighthouse_process

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PREFIX = "@goodput "
#: How long past the first group's finish the others may take before they are ended.
FINISH_GRACE_S = 5.0


def make_trace(
    seed: int, mean_s: float, groups: int, horizon_s: float = 7200.0
) -> list[tuple[float, int]]:
    """Seeded exponential inter-failure times of mean ``mean_s``, each killing a random rank."""
    rng = random.Random(seed)
    trace, t = [], 0.0
    while t < horizon_s:
        t += rng.expovariate(1.0 / mean_s)
        trace.append((round(t, 3), rng.randrange(groups)))
    return trace


def load_trace(path: Path, groups: int) -> list[tuple[float, int]]:
    """A trace file: one ``time victim`` pair a line (whitespace or comma), ``#`` comments."""
    trace = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].replace(",", " ").strip()
        if not line:
            continue
        t, victim = line.split()
        if not 0 <= int(victim) < groups:
            raise ValueError(f"{path}:{n}: victim {victim} is not a rank of {groups}")
        trace.append((float(t), int(victim)))
    return sorted(trace)


@dataclass
class WayRun:
    """One way's run: its events (goodput's, with ``group`` and ``inc``) and the kills applied."""

    name: str
    steps: int
    events: list[dict[str, Any]]
    kills: list[tuple[float, int]] = field(default_factory=list)  # (wall time, victim)
    t0: float = 0.0  # the job's first commit: the trace's zero
    t_end: float | None = None  # the job's commit of step N
    final_loss: float | None = None
    save_every: int = 0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @staticmethod
    def load(path: Path) -> WayRun:
        d = json.loads(path.read_text())
        d["kills"] = [tuple(k) for k in d["kills"]]
        return WayRun(**d)


class _Recorder:
    """Events in arrival order, the job's first commit and its step N, and who is up now."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.events: list[dict[str, Any]] = []
        self.t0: float | None = None
        self.t_end: float | None = None
        self.loss: float | None = None
        self.up: set[tuple[int, int]] = set()  # (group, inc) that committed a step

    def add(self, e: dict[str, Any]) -> None:
        self.events.append(e)
        if e["kind"] == "step" and e["committed"]:
            self.up.add((e["group"], e["inc"]))
            self.t0 = e["t"] if self.t0 is None else min(self.t0, e["t"])
            if e["after"] >= self.steps and self.t_end is None:
                self.t_end = e["t"]
        if e["kind"] == "done" and self.loss is None:
            self.loss = e["eval_loss"]


class _Trace:
    """The failures still to apply, each when its time has come and its victim is up."""

    def __init__(self, trace: list[tuple[float, int]]) -> None:
        self.pending = list(trace)

    def due(self, now: float, t0: float | None, is_up) -> int | None:
        if t0 is None or not self.pending or now - t0 < self.pending[0][0]:
            return None
        victim = self.pending[0][1]
        if not is_up(victim):
            return None
        self.pending.pop(0)
        return victim


def run_ckpt(args, trace, save_every: int, out: Path, name: str = "ckpt-restart") -> WayRun:
    """torchrun with restarts over ``args.groups`` ranks, a DCP save every ``save_every`` steps."""
    ckpt = out / f"{name}-checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(args.groups)]
    cmd += ["--max-restarts", "1000", "--monitor-interval", "0.1"]
    cmd += ["-m", "bench.versus_worker", "--mode", "ddp", "--steps", str(args.steps)]
    cmd += ["--save-every", str(save_every), "--ckpt-dir", str(ckpt)]
    cmd += ["--compute-s", str(args.compute_s), "--lr", str(args.lr)]
    env = {**os.environ, "LOGLEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    rec = _Recorder(args.steps)
    pids: dict[tuple[int, int], int] = {}
    arrivals: queue.Queue[dict[str, Any]] = queue.Queue()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PREFIX):
                    arrivals.put(json.loads(line[len(PREFIX) :]))
                else:
                    log.write(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        kills: list[tuple[float, int]] = []
        doomed: set[int] = set()
        failures = _Trace(trace)
        deadline = time.time() + args.deadline
        try:
            while proc.poll() is None:
                if time.time() > deadline:
                    raise RuntimeError(f"{name}: not at step {args.steps} after {args.deadline} s")
                try:
                    e = arrivals.get(timeout=0.05)
                    rec.add(e)
                    if e["kind"] == "exec":
                        pids[(e["group"], e["inc"])] = e["pid"]
                except queue.Empty:
                    pass
                inc = max((i for _, i in pids), default=0)  # torchrun's current restart
                # Once one rank is killed its whole incarnation is doomed: no rank of it is up.
                victim = failures.due(
                    time.time(), rec.t0, lambda g, i=inc: (g, i) in rec.up and i not in doomed
                )
                if victim is not None and rec.t_end is None:
                    with _suppress_gone():
                        os.kill(pids[(victim, inc)], signal.SIGKILL)
                    kills.append((time.time(), victim))
                    doomed.add(inc)
                    print(
                        f"  [{name}] t={time.time() - rec.t0:6.1f}s killed rank {victim}",
                        file=sys.stderr,
                    )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(5)
        while not arrivals.empty():
            rec.add(arrivals.get())
    if proc.returncode != 0 or rec.t_end is None:
        raise RuntimeError(
            f"{name}: torchrun exited {proc.returncode}; see {out / (name + '.log')}"
        )
    shutil.rmtree(ckpt, ignore_errors=True)
    return _finish(name, args.steps, rec, kills, save_every)


class _suppress_gone:
    """A victim that died on its own in the meantime is not an error."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, *_: object) -> bool:
        return kind is ProcessLookupError


class VersusJob(Job):
    """goodput's Job running :mod:`bench.versus_worker` to ``steps`` instead of its own worker."""

    def __init__(self, impl: str, lighthouse: str, args, out: Path, restart: str) -> None:
        self.steps, self.lr = args.steps, args.lr
        super().__init__(impl, lighthouse, args.groups, out, args.compute_s, restart)

    def command(self, group: int) -> list[str]:
        cmd = [sys.executable, "-m", "bench.versus_worker", "--mode", "ft", "--impl", self.impl]
        cmd += ["--group", str(group), "--lighthouse", self.lighthouse, "--steps", str(self.steps)]
        cmd += ["--stop-file", str(self.stop_file), "--compute-s", str(self.compute_s)]
        return [*cmd, "--lr", str(self.lr)]


def run_ft(args, trace, impl: str, restart: str, out: Path, name: str) -> WayRun:
    """``impl``'s replica groups to step N, each victim restarted ``restart`` right after its kill."""
    way = out / name
    shutil.rmtree(way, ignore_errors=True)
    way.mkdir(parents=True)
    rec = _Recorder(args.steps)
    kills: list[tuple[float, int]] = []
    with lighthouse_process(impl, way / "lighthouse.log") as addr:
        job = VersusJob(impl, addr, args, way, restart)
        try:
            # The spare imports at launch, before the groups start: it is ready for any failure.
            job.pool.fill()
            job.pool.wait_ready(120)
            for g in range(args.groups):
                job.start(g)
            failures = _Trace(trace)
            deadline = time.time() + args.deadline
            finished_at: float | None = None
            while finished_at is None or time.time() < finished_at + FINISH_GRACE_S:
                if time.time() > deadline:
                    raise RuntimeError(f"{name}: not at step {args.steps} after {args.deadline} s")
                job.drain(0.05)
                for e in job.events[len(rec.events) :]:
                    rec.add(e)
                if rec.t_end is not None and finished_at is None:
                    finished_at = time.time()
                if finished_at is not None and all(
                    p[-1].popen.poll() is not None for p in job.procs.values()
                ):
                    break
                if rec.t_end is None:
                    victim = failures.due(time.time(), rec.t0, job.up)
                    if victim is not None:
                        kills.append((job.kill(victim), victim))
                        job.start(victim)
                        print(
                            f"  [{name}] t={time.time() - rec.t0:6.1f}s killed g{victim}",
                            file=sys.stderr,
                        )
                    job.refill()
                    _check_running(job, name)
        finally:
            _end(job)
        for e in job.events[len(rec.events) :]:
            rec.add(e)
    return _finish(name, args.steps, rec, kills, 0)


def _check_running(job: VersusJob, name: str) -> None:
    """A group that exited before the job reached N (not killed by us) fails the run."""
    for procs in job.procs.values():
        p = procs[-1]
        if p.popen.poll() is not None and not any(
            e["kind"] == "done" and e["group"] == p.group for e in job.events
        ):
            tail = p.log.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(
                f"{name} g{p.group} exited with {p.popen.returncode}:\n" + "\n".join(tail)
            )


def _end(job: VersusJob) -> None:
    """Stops the groups still running (those behind, or waiting for peers that finished)."""
    job.stop_file.touch()
    for procs in job.procs.values():
        for p in procs:
            if p.popen.poll() is None:
                with _suppress_gone():
                    os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
    job.pool.close()
    job.drain(0.5)


def _finish(name: str, steps: int, rec: _Recorder, kills, save_every: int) -> WayRun:
    if rec.t_end is None or rec.t0 is None:
        raise RuntimeError(f"{name}: the job never reached step {steps}")
    return WayRun(name, steps, rec.events, kills, rec.t0, rec.t_end, rec.loss, save_every)
