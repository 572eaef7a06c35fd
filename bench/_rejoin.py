"""A rejoin, timed phase by phase on both sides: the harness behind ``bench/recovery.py``.

Two replica groups (one rank each, Gloo, loopback) train an MLP of ~5.2M parameters with AdamW
(~63 MB of state with the optimizer's moments, plus ``--state-mb`` of ballast) against a
lighthouse in its own process at the reference's defaults (``min_replicas=1``, join timeout
100 ms, tick 100 ms, heartbeat timeout 5 s). Group 1 is SIGKILLed once both have trained
together for a while, restarted once the survivor has committed a few steps alone, and the run
ends once the restarted group has committed a few steps of its own.

Each worker prints one line per event (``@rejoin {...}``, wall-clock times): its first line of
code, the end of its imports, the Manager's construction, every step (begin, after backward,
after the optimizer step), and, for torchheal with ``timeline``, every mark of
``torchheal.checkpointing.timeline`` (quorum, rebuild, snapshot, staging, transfer, load).

With ``--pin`` each group's process (all its threads) runs on a CPU of its own (group g on
CPU g mod the CPU count), the lighthouse and the driver wherever the scheduler puts them: as
when groups run on separate machines, a group's step then slows only for what it does itself
(serving a peer) and for what it waits on, not because the other group's work took its core.

    python -m bench._rejoin --impl torchheal --timeline     # one run, its timeline printed
"""

from __future__ import annotations

import time

T_EXEC = time.time()  # the first line this process runs: interpreter start-up is before it

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "@rejoin "

# ---------------------------------------------------------------------------------------------
# Worker: one replica group


def _emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def worker(args: argparse.Namespace) -> None:
    _emit("exec", t=T_EXEC)
    if args.pin:
        os.sched_setaffinity(0, {args.group % (os.cpu_count() or 1)})
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    ft = importlib.import_module(args.impl)
    # The library's own imports (torchheal loads its parts lazily) belong to start-up too.
    _ = (ft.Manager, ft.ProcessGroupGloo, ft.DistributedDataParallel, ft.Optimizer)
    importlib.import_module(f"{args.impl}.checkpointing")
    torch.set_num_threads(1)  # two groups share two cores
    if args.timeline:

        class _Marks(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                _emit(
                    "mark",
                    t=record.created,
                    phase=getattr(record, "phase", record.getMessage()),
                    thread=record.threadName,
                    **getattr(record, "fields", {}),
                )

        tl = logging.getLogger("torchheal.timeline")
        tl.setLevel(logging.DEBUG)
        tl.addHandler(_Marks())
        tl.propagate = False

    group = args.group
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 512)
    )
    if args.state_mb:
        model.register_buffer("ballast", torch.zeros(args.state_mb * (1 << 20) // 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Building the optimizer imports much of torch lazily (seconds): start-up, paid by both.
    _emit("imported")
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ft.ProcessGroupGloo(timeout=timeout)
    transport = None  # the Manager's default: HTTP
    if args.transport == "pg":
        mod = importlib.import_module(f"{args.impl}.checkpointing.pg_transport")
        transport = mod.PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    _emit("manager.begin")
    manager = ft.Manager(
        pg=pg,
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
        replica_id=f"rejoin_{group}",
        checkpoint_transport=transport,
    )
    _emit("manager.end")
    if args.freeze_file is not None:
        _stop_in_allreduce(manager, Path(args.freeze_file))
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)
    stop = Path(args.stop_file)
    while not stop.exists():
        before = manager.current_step()
        g = torch.Generator().manual_seed(group * 1_000_003 + before)
        x, y = torch.randn(32, 1024, generator=g), torch.randn(32, 512, generator=g)
        t0 = time.time()
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        t1 = time.time()
        optimizer.step()
        t2 = time.time()
        after = manager.current_step()
        _emit(
            "step",
            t=t2,
            begin=t0,
            backward=t1,
            before=before,
            step=after,
            committed=after > before,
            healed=after > before + 1,
            participants=manager.num_participants(),
        )
    manager.shutdown(wait=False)
    _emit("done")
    os._exit(0)  # skip slow interpreter teardown (gloo, grpc threads)


def _stop_in_allreduce(manager: Any, freeze: Path) -> None:
    """Freezes this process (SIGSTOP) right after it starts an allreduce, once ``freeze`` exists.

    Both libraries' DDP comm hooks call ``manager.allreduce``: the collective is under way and
    its peers wait in it for data this process will not send until it is continued.
    """
    real = manager.allreduce
    done = False

    def allreduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal done
        work = real(tensor, *args, **kwargs)
        if not done and freeze.exists():
            done = True
            _emit("stopping", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGSTOP)
            _emit("continued")
        return work

    manager.allreduce = allreduce


# ---------------------------------------------------------------------------------------------
# Driver


@dataclass
class Proc:
    """A worker process and the events it printed (read on a thread)."""

    group: int
    popen: subprocess.Popen[str]
    started: float
    events: list[dict[str, Any]] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith(PREFIX):
                event = json.loads(line[len(PREFIX) :])
                with self.changed:
                    self.events.append(event)
                    self.changed.notify_all()
            else:
                self.output.append(line.rstrip())
        with self.changed:
            self.changed.notify_all()

    def commits(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == "step" and e["committed"]]

    def wait_for(self, predicate: Any, what: str, timeout: float = 180.0) -> None:
        deadline = time.time() + timeout
        with self.changed:
            while not predicate(self):
                if self.popen.poll() is not None and not predicate(self):
                    raise RuntimeError(
                        f"group {self.group} exited ({self.popen.returncode}) before {what}:\n"
                        + "\n".join(self.output[-30:])
                    )
                left = deadline - time.time()
                if left <= 0:
                    raise TimeoutError(f"group {self.group}: no {what} within {timeout} s")
                self.changed.wait(min(left, 0.5))


@contextlib.contextmanager
def lighthouse_process(impl: str) -> Iterator[str]:
    """A lighthouse of ``impl`` in its own process, at the reference's defaults."""
    from bench import _procs

    port = _procs.free_port()
    # Through Python rather than the console scripts, which a bare environment may lack.
    cmd = [sys.executable, "-m", "bench._rejoin", "lighthouse", "--impl", impl, "--port", str(port)]
    env = {**os.environ, "RUST_LOG": "warn"}
    with _procs.lighthouse_process(cmd, port, env=env, start_s=60) as addr:
        yield addr


def _start(group: int, impl: str, lighthouse: str, stop_file: str, extra: list[str]) -> Proc:
    cmd = [sys.executable, "-m", "bench._rejoin", "worker", "--impl", impl, "--group", str(group)]
    cmd += ["--lighthouse", lighthouse, "--stop-file", stop_file, *extra]
    env = {"LOGLEVEL": "WARNING", **os.environ, "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}
    started = time.time()
    popen = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    proc = Proc(group, popen, started)
    threading.Thread(target=proc.read, daemon=True).start()
    return proc


@dataclass
class Rejoin:
    """What one rejoin cost (seconds; None where the run could not tell).

    Args:
        impl: torchheal or torchft.
        startup_s: restart to the end of the restarted process's imports (interpreter start-up,
            torch and the library, and the model and optimizer, whose construction imports
            more of torch): paid by both libraries, reported apart.
        rest_s: end of that to the first commit.
        manager_to_commit_s: the Manager's construction beginning to the first commit.
        total_s: restart to the first commit.
        transfer_s: the healer's receive of the state's bytes (torchheal timeline only).
        transfer_bytes: how many bytes that was.
        normal_step_s: the survivor's median step, both groups training together.
        survivor_max_s: the survivor's longest step from the healer's Manager construction to
            its fifth commit.
        survivor_max_startup_s: the survivor's longest step while the restarted process started
            (interpreter and imports: CPU contention on a shared machine).
        healed: the restarted group's first commit was a heal.
        marks: the timeline (torchheal with ``timeline``).
    """

    impl: str
    startup_s: float
    rest_s: float | None
    manager_to_commit_s: float | None
    total_s: float | None
    transfer_s: float | None
    transfer_bytes: int | None
    normal_step_s: float
    survivor_max_s: float | None
    survivor_max_startup_s: float | None
    healed: bool
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    restart: float = 0.0


def run_rejoin(
    impl: str,
    *,
    state_mb: int = 0,
    transport: str = "http",
    together: int = 20,
    alone: int = 8,
    after: int = 10,
    timeline: bool = False,
    pin: bool = False,
) -> Rejoin:
    """One kill, restart and rejoin of group 1 of 2; see the module docstring.

    Args:
        impl: "torchheal" or "torchft".
        state_mb: ballast added to the state (not to the allreduce).
        transport: "http" or "pg".
        together: steps both groups commit together before the kill.
        alone: steps the survivor commits alone before the restart.
        after: steps the restarted group commits before the run ends.
        timeline: record torchheal's phase marks.
        pin: each group on a CPU of its own (see the module docstring).
    """
    extra = ["--state-mb", str(state_mb), "--transport", transport]
    if pin:
        extra.append("--pin")
    if timeline:
        extra.append("--timeline")
    with (
        tempfile.TemporaryDirectory() as tmp,
        lighthouse_process(impl) as addr,
    ):
        stop = os.path.join(tmp, "stop")
        procs = [_start(g, impl, addr, stop, extra) for g in range(2)]
        try:
            survivor = procs[0]
            survivor.wait_for(
                lambda p: sum(1 for c in p.commits() if c["participants"] == 2) >= together,
                f"{together} commits with both groups",
            )
            victim = procs[1]
            os.killpg(victim.popen.pid, signal.SIGKILL)
            victim.popen.wait()
            killed = time.time()
            survivor.wait_for(
                lambda p: sum(1 for c in p.commits() if c["t"] > killed) >= alone,
                f"{alone} commits alone",
            )
            restarted = _start(1, impl, addr, stop, extra)
            procs.append(restarted)
            restarted.wait_for(lambda p: len(p.commits()) >= after, f"{after} commits", 300)
        finally:
            Path(stop).touch()
            for p in procs:
                try:
                    p.popen.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait()
    return _measure(impl, survivor, restarted, killed)


def _first(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in events if e["kind"] == kind), None)


def _measure(impl: str, survivor: Proc, healer: Proc, killed: float) -> Rejoin:
    restart = healer.started
    imported = _first(healer.events, "imported")
    manager = _first(healer.events, "manager.begin")
    commits = healer.commits()
    first = commits[0] if commits else None
    steps = [e for e in survivor.events if e["kind"] == "step"]
    intervals = [(b["t"], b["t"] - a["t"]) for a, b in itertools.pairwise(steps)]
    together = [
        d
        for (t, d), s in zip(intervals, steps[1:], strict=True)
        if t < killed and s["participants"] == 2
    ]
    normal = statistics.median(together[5:] or together)
    survivor_max = None
    survivor_max_startup = None
    if manager is not None and len(commits) >= 5:
        window = [d for t, d in intervals if manager["t"] < t <= commits[4]["t"] + 1e-3]
        # The step in flight when the Manager began ends inside the window: it counts too.
        survivor_max = max(window) if window else None
    if imported is not None:
        window = [d for t, d in intervals if restart < t <= imported["t"]]
        survivor_max_startup = max(window) if window else None
    marks = [e for e in healer.events if e["kind"] == "mark"]
    begin = next((m for m in marks if m["phase"] == "fetch.data.begin"), None)
    end = next((m for m in marks if m["phase"] == "fetch.data.end"), None)
    return Rejoin(
        impl=impl,
        startup_s=(imported["t"] - restart) if imported else float("nan"),
        rest_s=(first["t"] - imported["t"]) if first and imported else None,
        manager_to_commit_s=(first["t"] - manager["t"]) if first and manager else None,
        total_s=(first["t"] - restart) if first else None,
        transfer_s=(end["t"] - begin["t"]) if begin and end else None,
        transfer_bytes=begin.get("nbytes") if begin else None,
        normal_step_s=normal,
        survivor_max_s=survivor_max,
        survivor_max_startup_s=survivor_max_startup,
        healed=bool(first and first["healed"]),
        events={"survivor": survivor.events, "healer": healer.events},
        restart=restart,
    )


#: The healer's path from its Manager's construction to its first commit, one phase per pair of
#: consecutive marks: (phase name, the mark that ends it). Each phase begins where the one
#: before it ended, so the phases add up to Manager -> first commit. The healer's own forward
#: and backward of the heal step, and the source's staging, run beside these (not on the path).
CRITICAL_PATH = (
    ("construct", "manager.end"),  # the Manager: endpoints, lighthouse hello
    ("to first step", "warmup.begin"),  # the user's code between (DDP and optimizer wrappers)
    ("warm-up", "warmup.end"),  # the local first step's forward and backward
    ("to quorum", "quorum.begin"),  # the warm-up's optimizer call, the next step's zero_grad
    ("quorum", "quorum.end"),  # waiting for the survivors' step boundary, the round
    ("to metadata", "metadata.begin"),
    ("metadata", "metadata.end"),  # the source's transport address, over gRPC
    ("wait source", "fetch.data.begin"),  # the HTTP request; the source's staging if not done
    ("transfer", "fetch.data.end"),  # the bytes, checked as they arrive
    ("load", "load.end"),  # the training thread loads the received state
    ("vote + optimizer", "commit"),  # the commit vote and the user's optimizer step
)


def critical_path(r: Rejoin) -> list[tuple[str, float]] | None:
    """The healer's Manager -> first commit, phase by phase (:data:`CRITICAL_PATH`), seconds.

    None without torchheal's timeline marks, or when the first commit was not a heal after a
    warm-up (a run whose phases are not these). Each mark is the first of its name after the
    previous one, so a quorum that failed and was retried shows as a longer ``quorum``.
    """
    healer = r.events.get("healer", [])
    manager = _first(healer, "manager.begin")
    first = next((e for e in healer if e["kind"] == "step" and e["committed"]), None)
    if manager is None or first is None or not r.healed:
        return None
    marks = sorted(
        [
            (e["t"], e.get("phase", e["kind"]))
            for e in healer
            if e["kind"] in ("mark", "manager.end")
        ]
        + [(first["t"], "commit")]
    )
    out, t = [], manager["t"]
    for name, end in CRITICAL_PATH:
        at = next((m for m, phase in marks if phase == end and m >= t), None)
        if at is None:
            return None
        out.append((name, at - t))
        t = at
    return out


def print_timeline(r: Rejoin) -> None:
    """Both sides' events from the healer's Manager construction to its third commit."""
    healer = r.events["healer"]
    manager = _first(healer, "manager.begin")
    commits = [e for e in healer if e["kind"] == "step" and e["committed"]]
    if manager is None or not commits:
        print("no timeline: the restarted group never committed")
        return
    t0 = manager["t"]
    t1 = commits[min(2, len(commits) - 1)]["t"]
    rows = []
    for side, events in r.events.items():
        for e in events:
            if e["kind"] == "step" and t0 - 0.5 <= e["t"] <= t1 + 0.01:
                rows.append((e["begin"], side, f"step.begin (step {e['before']})"))
                rows.append((e["backward"], side, "backward.end"))
                rows.append(
                    (
                        e["t"],
                        side,
                        f"optimizer.end committed={e['committed']} participants={e['participants']}",
                    )
                )
            elif (
                e["kind"] in ("mark", "manager.begin", "manager.end")
                and t0 - 0.5 <= e["t"] <= t1 + 0.01
            ):
                extra = {k: v for k, v in e.items() if k not in ("kind", "t", "phase", "thread")}
                name = e.get("phase", e["kind"])
                rows.append((e["t"], side, f"{name} [{e.get('thread', 'main')}] {extra or ''}"))
    print(f"\ntimeline of {r.impl} (ms from the healer's Manager construction)")
    for t, side, what in sorted(rows):
        print(f"{(t - t0) * 1000:9.1f}  {side:<9} {what}")


def serve_lighthouse(impl: str, port: int) -> None:
    """A lighthouse at the reference's defaults until this process is terminated."""
    mod = importlib.import_module(
        "torchft.coordination" if impl == "torchft" else "torchheal.coordination"
    )
    server = mod.LighthouseServer(
        bind=f"127.0.0.1:{port}",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=5000,
    )
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--port", type=int, required=True)
    lh.add_argument("--impl", default="torchheal")
    w = sub.add_parser("worker")
    w.add_argument("--impl", default="torchheal")
    w.add_argument("--group", type=int, required=True)
    w.add_argument("--lighthouse", required=True)
    w.add_argument("--stop-file", required=True)
    w.add_argument("--state-mb", type=int, default=0)
    w.add_argument("--transport", choices=["http", "pg"], default="http")
    w.add_argument("--timeline", action="store_true")
    w.add_argument("--pin", action="store_true")
    w.add_argument("--freeze-file", default=None)
    parser.add_argument("--impl", default="torchheal")
    parser.add_argument("--state-mb", type=int, default=0)
    parser.add_argument("--transport", choices=["http", "pg"], default="http")
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--pin", action="store_true", help="each group on a CPU of its own")
    args = parser.parse_args()
    if args.cmd == "worker":
        worker(args)
        return
    if args.cmd == "lighthouse":
        serve_lighthouse(args.impl, args.port)
        return
    r = run_rejoin(
        args.impl,
        state_mb=args.state_mb,
        transport=args.transport,
        timeline=args.timeline,
        pin=args.pin,
    )
    if args.timeline:
        print_timeline(r)
        path = critical_path(r)
        if path is not None:
            print("\nthe healer's Manager -> first commit, phase by phase (ms)")
            for name, s in path:
                print(f"  {name:<18}{1000 * s:8.1f}")
    shown = {k: v for k, v in r.__dict__.items() if k not in ("events",)}
    print(json.dumps(shown, indent=1))


if __name__ == "__main__":
    main()
