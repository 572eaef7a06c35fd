"""Do replica groups train together? Full-quorum ratio at the reference's lighthouse defaults.

N replica groups (1 rank each, its own process and TCPStore) train a model with fault-tolerant
DDP at ``min_replica_size=1`` against a lighthouse in its own process with ``min_replicas=1``,
``join_timeout_ms=100``, ``quorum_tick_ms=100``, ``heartbeat_timeout_ms=5000`` (the reference's
defaults). Nothing fails. A healthy job commits every step with every group participating; a job
whose groups "take turns" commits steps with fewer participants while the others heal.

Two cases (issue 8):

* ``a``: a ~5.2M-parameter MLP with AdamW, batch 32, one torch thread (steps ~0.1 s on 2 cores).
* ``b``: ``examples/train_ddp.py``'s small CNN with ``--sleep`` seconds (default 0.15) after the
  forward pass, so a step is longer than the join timeout.

For each run: the fraction of commits (over every group, once warm) made with all N groups
participating, the job's steps/s, heals, and distinct quorum ids. Managers and lighthouse can be
either implementation (the reference's only where torchft is installed), side by side.

    python -m bench.together --case a --groups 3 --runs 10
    python -m bench.together --case b --groups 2,3,4 --runs 10 --impls torchheal/torchheal,torchft/torchft
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
#: How long a run waits for every group's first commit before it gives up on it.
START_UP_LIMIT_S = 180.0


# ---------------------------------------------------------------------------------------------
# Worker: one replica group


def _emit(kind: str, **fields: object) -> None:
    sys.stdout.write(
        "@together " + json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n"
    )
    sys.stdout.flush()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    if os.environ.get("BENCH_LOGDIR"):
        import logging

        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s.%(msecs)03d %(name)s %(message)s",
            datefmt="%H:%M:%S",
        )
    ft = importlib.import_module(args.impl)
    group = args.group
    torch.manual_seed(0)
    if args.case == "a":
        model = nn.Sequential(
            nn.Linear(1024, 2048),
            nn.ReLU(),
            nn.Linear(2048, 1536),
            nn.ReLU(),
            nn.Linear(1536, 512),
        )

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(group * 1_000_003 + step)
            return torch.randn(32, 1024, generator=g), torch.randn(32, 512, generator=g)

        loss_fn = nn.functional.mse_loss
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 8 * 8, 128),
            nn.ReLU(),
            nn.Linear(128, 10),
        )

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(group * 1_000_003 + step)
            return torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)

        loss_fn = nn.functional.cross_entropy
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"together_{group}",
    )
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)
    _emit("start", group=group)
    # The driver creates the stop file ``--duration`` s after every group has committed (a
    # group's start-up can take many seconds on a loaded machine); a hard end in case it never
    # does.
    end = time.time() + args.duration + START_UP_LIMIT_S
    while time.time() < end and not os.path.exists(args.stop_file):
        before = manager.current_step()
        t0 = time.time()
        optimizer.zero_grad()
        t1 = time.time()
        x, y = batch(before)
        out = ddp(x)
        if args.sleep:
            time.sleep(args.sleep)
        loss_fn(out, y).backward()
        t2 = time.time()
        optimizer.step()
        t3 = time.time()
        after = manager.current_step()
        _emit(
            "step",
            group=group,
            step=after,
            before=before,
            committed=after > before,
            healed=after > before + 1,
            participants=manager.num_participants(),
            quorum_id=manager._quorum_id,
            t=[t0, t1, t2, t3],
        )
    _emit("done", group=group)
    manager.shutdown(wait=False)


# ---------------------------------------------------------------------------------------------
# Driver


@contextlib.contextmanager
def _lighthouse(impl: str, join_timeout_ms: int) -> Iterator[str]:
    # Driver side only: workers run this file as a script, without the package on their path.
    from bench._procs import free_port, lighthouse_command, lighthouse_process

    port = free_port()
    logdir = os.environ.get("BENCH_LOGDIR")
    with (
        open(os.path.join(logdir, f"lighthouse-{port}.log"), "w")
        if logdir
        else contextlib.nullcontext(subprocess.DEVNULL) as log,
        lighthouse_process(
            lighthouse_command(impl, port, join_timeout_ms),
            port,
            log,
            {**os.environ, "RUST_LOG": "info"},
        ) as addr,
    ):
        yield addr


@dataclass
class RunStats:
    full_ratio: float
    commits: int
    steps_per_s: float
    heals: int
    quorum_ids: int
    first_full_s: float | None


def _read_events(proc: subprocess.Popen[str], events: list[dict], changed: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("@together "):
            events.append(json.loads(line[len("@together ") :]))
            changed.set()


def _stop_when_trained(
    args: argparse.Namespace, groups: int, events: list[dict], changed: threading.Event, stop: str
) -> None:
    """Creates ``stop`` ``warmup + duration`` s after every group's first commit."""
    deadline = time.time() + START_UP_LIMIT_S
    while time.time() < deadline:
        if len({e["group"] for e in list(events) if e.get("committed")}) >= groups:
            time.sleep(args.warmup + args.duration)
            break
        changed.wait(0.5)
        changed.clear()
    Path(stop).touch()


def run_once(args: argparse.Namespace, managers: str, lighthouse: str, groups: int) -> RunStats:
    with (
        _lighthouse(lighthouse, args.join_timeout_ms) as addr,
        tempfile.TemporaryDirectory() as tmp,
    ):
        stop_file = os.path.join(tmp, "stop")
        procs = []
        for g in range(groups):
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--impl",
                managers,
                "--group",
                str(g),
                "--lighthouse",
                addr,
                "--case",
                args.case,
                "--duration",
                str(args.duration),
                "--sleep",
                str(args.sleep if args.case == "b" else 0.0),
                "--stop-file",
                stop_file,
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "info"}
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=open(
                        os.path.join(
                            os.environ["BENCH_LOGDIR"], f"g{g}-{addr.rsplit(':', 1)[1]}.log"
                        ),
                        "w",
                    )
                    if os.environ.get("BENCH_LOGDIR")
                    else subprocess.DEVNULL,
                    text=True,
                    env=env,
                    cwd=ROOT,
                )
            )
        events: list[dict] = []
        changed = threading.Event()
        readers = [
            threading.Thread(target=_read_events, args=(p, events, changed), daemon=True)
            for p in procs
        ]
        for r in readers:
            r.start()
        _stop_when_trained(args, groups, events, changed, stop_file)
        for p in procs:
            p.wait(timeout=args.duration + 120)
        for r in readers:
            r.join(10)
    if os.environ.get("BENCH_LOGDIR"):
        name = f"events-{managers}-{lighthouse}-{groups}-{int(time.time())}.json"
        with open(os.path.join(os.environ["BENCH_LOGDIR"], name), "w") as f:
            json.dump(events, f)
    steps = [e for e in events if e["kind"] == "step"]
    starts = [e["time"] for e in events if e["kind"] == "start"]
    dones = [e["time"] for e in events if e["kind"] == "done"]
    first_commit = {}
    for e in sorted(steps, key=lambda e: e["time"]):
        if e["committed"]:
            first_commit.setdefault(e["group"], e["time"])
    if len(first_commit) < groups:
        return RunStats(0.0, 0, 0.0, 0, 0, None)
    warm = max(first_commit.values()) + args.warmup
    end = min(dones) if dones else max(e["time"] for e in steps)
    window = [e for e in steps if warm <= e["time"] <= end and e["committed"]]
    full = [e for e in window if e["participants"] == groups]
    job_steps = {e["step"] for e in window}
    first_full = next(
        (e["time"] for e in sorted(steps, key=lambda e: e["time"]) if e["participants"] == groups),
        None,
    )
    return RunStats(
        full_ratio=len(full) / len(window) if window else 0.0,
        commits=len(window),
        steps_per_s=len(job_steps) / (end - warm) if end > warm else 0.0,
        heals=sum(1 for e in steps if e["healed"] and e["time"] >= warm),
        quorum_ids=len({e["quorum_id"] for e in window}),
        first_full_s=(first_full - min(starts)) if first_full and starts else None,
    )


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
    p.add_argument("--case", choices=["a", "b"], default="a")
    p.add_argument("--groups", default="3", help="comma-separated group counts")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--duration",
        type=float,
        default=20.0,
        help="seconds measured, from --warmup s after every group's first commit",
    )
    p.add_argument(
        "--warmup", type=float, default=5.0, help="seconds after the last group's first commit"
    )
    p.add_argument("--sleep", type=float, default=0.15, help="case b: seconds after forward")
    p.add_argument("--join-timeout-ms", type=int, default=100)
    p.add_argument(
        "--impls",
        default=None,
        help="managers/lighthouse pairs, comma-separated (default: torchheal/torchheal and, "
        "when installed, torchft/torchft)",
    )
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    pairs = (
        [tuple(x.split("/")) for x in args.impls.split(",")]
        if args.impls
        else [("torchheal", "torchheal")]
        + ([("torchft", "torchft")] if reference_available() else [])
    )
    print(
        f"case {args.case}: min_replicas=1, join {args.join_timeout_ms} ms, tick 100 ms, "
        f"heartbeat timeout 5 s; {args.duration:.0f} s measured per run, from {args.warmup:.0f} s after every group first committed"
        + (f", sleep {args.sleep} s after forward" if args.case == "b" else ""),
        flush=True,
    )
    header = f"{'managers/lighthouse':<22}{'groups':>7}{'run':>5}{'full%':>8}{'commits':>9}{'steps/s':>9}{'heals':>7}{'qids':>6}{'1st full s':>11}"
    print(header, flush=True)
    summary = []
    for groups in [int(g) for g in args.groups.split(",")]:
        for run in range(args.runs):
            for managers, lighthouse in pairs:
                s = run_once(args, managers, lighthouse, groups)
                summary.append((f"{managers}/{lighthouse}", groups, s))
                first = f"{s.first_full_s:.1f}" if s.first_full_s is not None else "-"
                print(
                    f"{managers + '/' + lighthouse:<22}{groups:>7}{run:>5}{100 * s.full_ratio:>7.1f}%"
                    f"{s.commits:>9}{s.steps_per_s:>9.2f}{s.heals:>7}{s.quorum_ids:>6}{first:>11}",
                    flush=True,
                )
    print("\nsummary (per pair and group count): runs >= 99% full, min full%, median steps/s")
    keys = sorted({(name, g) for name, g, _ in summary})
    for name, g in keys:
        rows = [s for n, gg, s in summary if n == name and gg == g]
        ok = sum(1 for s in rows if s.full_ratio >= 0.99)
        print(
            f"{name:<22}{g:>7}  {ok}/{len(rows)} runs >= 99%   min {100 * min(s.full_ratio for s in rows):.1f}%"
            f"   median {statistics.median(s.steps_per_s for s in rows):.2f} steps/s"
        )


if __name__ == "__main__":
    main()
