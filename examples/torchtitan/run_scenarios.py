"""torchtitan 0.3.0 with fault tolerance on CPU: the scenarios of the example, checked.

Each scenario starts a lighthouse (the venv's ``torchft_lighthouse``: torchheal's in
``.venv-titan``, the reference's in ``.venv-titan-ref``) and two replica groups, each its own
``torchrun`` job of one process running ``cpu_train.py`` with torchtitan's FT flags, over Gloo.
Nothing is downloaded: the data and tokenizer come from ``make_assets.py``.

Scenarios (``--scenario``, repeatable; default: all torchheal ones, then the reference's kill):

* ``per_step``   per-step FT (async quorum, FSDP all-reduce hook over ManagedProcessGroup);
                 both groups finish, and the gradient norm is equal across groups at every step.
* ``diloco``     DiLoCo, 2 fragments, sync every 4 steps; both finish.
* ``local_sgd``  LocalSGD, sync every 3 steps; both finish.
* ``kill``       per-step; group 1 is SIGKILLed (its whole torchrun job) at step K and restarted
                 once group 0 has trained 4 steps alone. Group 0 must go on alone, group 1 must
                 heal live from it (its first step jumps past K, with group 0's loss), both must
                 finish with rc 0, and the losses must fall. Measured, not checked: the
                 survivor's step time while the restarted group starts, warms up, heals and
                 takes its first full step, against its normal step (issue 9, goal 4).

``--venv .venv-titan-ref`` runs the same with the real torchft: its ``kill`` is expected to
crash the healthy group ("mixed torch.Tensor and DTensor"); that is reported, not failed.

Usage (from the repository root; ``make torchtitan`` runs it for both venvs)::

    .venv-titan/bin/python examples/torchtitan/run_scenarios.py --venv .venv-titan
    .venv-titan/bin/python examples/torchtitan/run_scenarios.py --venv .venv-titan-ref \\
        --scenario kill

Exit status 0 when every checked scenario passed. One scenario runs at a time (~40-120 s each on
2 cores); logs are kept under ``runs-titan/<venv>/<scenario>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([-\d.naninf]+)\s+grad_norm:\s+([-\d.naninf]+)")
# torchtitan's logger stamps each line: "[titan] 2026-11-26 06:11:30,697 - root - INFO - step: 1".
STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - ")
CRASH_TEXT = "mixed torch.Tensor and DTensor"
WARMUP_DONE = "warm-up step done (not committed)"
# torchheal's commit decision (printed by cpu_train.py with FT_LOG_COMMITS=1).
COMMIT_LINE = re.compile(r"should_commit=True \(local vote \w+: (\d+) participants")


@dataclass
class Scenario:
    name: str
    semi_sync: str | None
    steps: int
    sync_steps: int | None = None
    kill_at: int | None = None  # group 1 is killed when it logs this step
    alone_steps: int = 4  # group 0 trains this many steps alone before the restart


SCENARIOS = {
    "per_step": Scenario("per_step", None, steps=12),
    "diloco": Scenario("diloco", "diloco", steps=12, sync_steps=4),
    "local_sgd": Scenario("local_sgd", "local_sgd", steps=9, sync_steps=3),
    "kill": Scenario("kill", None, steps=30, kill_at=8),
}


@dataclass
class Run:
    """One torchrun job (one incarnation of one replica group)."""

    group: int
    incarnation: int
    log: Path
    proc: subprocess.Popen[bytes]
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (loss, gnorm)
    ended: dict[int, float] = field(default_factory=dict)  # step -> when its line was logged
    warmup_step: int | None = None  # the step number torchtitan logged for the warm-up

    def parse(self) -> None:
        text = ANSI.sub("", self.log.read_text(errors="replace"))
        # A group restarted into a running job first takes one local step that commits
        # nothing (torchheal's warm-up); torchtitan logs it like any step: leave it out.
        warmup = text.find(WARMUP_DONE)
        lines = list(STEP_LINE.finditer(text, max(warmup, 0)))
        if warmup >= 0 and lines:
            self.warmup_step = int(lines.pop(0).group(1))
        for m in lines:
            self.steps[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
            line_start = text.rfind("\n", 0, m.start()) + 1
            stamp = STAMP.match(text, line_start)
            if stamp is not None:
                when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
                self.ended[int(m.group(1))] = when.timestamp()

    def text(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace"))

    @property
    def last_step(self) -> int:
        self.parse()
        return max(self.steps, default=0)


def _descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), children first."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            out += [*_descendants(child), child]
    return out


def free_port() -> int:
    """A port the OS says is free (the lighthouse CLI needs a port number up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, deadline: float, what: str, poll: float = 0.2, job: Job | None = None) -> None:
    while not cond():
        if job is not None and job.lighthouse.poll() is not None:
            raise RuntimeError(f"the lighthouse exited ({job.lighthouse.returncode}); see its log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(poll)


def library_of(venv: Path) -> str:
    code = (
        "import importlib.metadata as m\n"
        "for d in ('torchheal-as-torchft', 'torchft-nightly'):\n"
        "    try: print(d, m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    out = subprocess.run([venv / "bin/python", "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


class Job:
    """A lighthouse plus the replica groups of one scenario, all under ``out``."""

    def __init__(self, venv: Path, out: Path, assets: Path) -> None:
        self.venv, self.out, self.assets = venv, out, assets
        # A fresh folder: torchtitan would resume from a previous run's final checkpoint.
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        self.port = free_port()
        self.env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            HF_DATASETS_OFFLINE="1",
            HF_HUB_OFFLINE="1",
            RUST_LOG="warn",
            TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.port}",
            FT_LOG_COMMITS="1",
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        lh_log = open(out / "lighthouse.log", "wb")
        self.lighthouse = self._spawn(
            [
                str(venv / "bin/torchft_lighthouse"),
                "--min_replicas",
                "1",
                "--quorum_tick_ms",
                "100",
                "--join_timeout_ms",
                "10000",
                "--bind",
                f"127.0.0.1:{self.port}",
            ],
            lh_log,
        )
        wait_for(self._lighthouse_up, time.monotonic() + 30, "the lighthouse to listen")

    def _lighthouse_up(self) -> bool:
        if self.lighthouse.poll() is not None:
            raise RuntimeError(f"lighthouse exited with {self.lighthouse.returncode}")
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def _spawn(self, cmd: list[str], log) -> subprocess.Popen[bytes]:
        # Own session: a kill reaches torchrun and its worker, and nothing else.
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.out,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def group(self, sc: Scenario, group: int, incarnation: int) -> Run:
        args = [
            "--module",
            "torchft.llama3",
            "--config",
            "llama3_torchft_debugmodel",
            "--fault_tolerance.enable",
            f"--fault_tolerance.replica_id={group}",
            "--fault_tolerance.group_size=2",
            "--fault_tolerance.process_group",
            "gloo",
            "--fault_tolerance.semi_sync_method",
            sc.semi_sync or "None",
            # torchft needs the state functions, which torchtitan sets only with checkpointing
            # on; a large interval keeps healing purely live (nothing on disk mid-run).
            "--checkpoint.enable",
            "--checkpoint.interval",
            "1000",
            "--validator.no-enable",
            "--profiler.no-enable-profiling",
            "--training.steps",
            str(sc.steps),
            "--training.seq_len",
            "256",
            "--training.local_batch_size",
            "2",
            "--hf_assets_path",
            str(self.assets / "tokenizer"),
            "--dataloader.dataset_path",
            str(self.assets / "c4_test"),
            "--dump_folder",
            str(self.out / f"dump_{group}"),
        ]
        if sc.sync_steps is not None:
            args += ["--fault_tolerance.sync_steps", str(sc.sync_steps)]
        cmd = [
            str(self.venv / "bin/torchrun"),
            "--nproc_per_node=1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint=localhost:0",
            str(HERE / "cpu_train.py"),
            *args,
        ]
        log_path = self.out / f"group{group}.{incarnation}.log"
        proc = self._spawn(cmd, open(log_path, "wb"))
        return Run(group, incarnation, log_path, proc)

    def kill(self, run: Run) -> None:
        """SIGKILL of the whole job: torchrun and its workers (which torchrun puts in sessions
        of their own, so a process-group kill would miss them)."""
        for pid in [*_descendants(run.proc.pid), run.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.proc.wait(30)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for pid in [*_descendants(proc.pid), proc.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait(30)


def _falls(steps: dict[int, tuple[float, float]]) -> bool:
    losses = [steps[s][0] for s in sorted(steps)]
    k = max(1, len(losses) // 4)
    return len(losses) >= 4 and sum(losses[-k:]) / k < sum(losses[:k]) / k


def run_scenario(sc: Scenario, venv: Path, out: Path, assets: Path, deadline_s: float) -> dict:
    job = Job(venv, out, assets)
    started = time.monotonic()
    deadline = started + deadline_s
    result: dict = {"scenario": sc.name, "checks": {}, "notes": []}
    runs: list[Run] = []
    restarted_at: float | None = None
    try:
        g0, g1 = job.group(sc, 0, 0), job.group(sc, 1, 0)
        runs += [g0, g1]
        if sc.kill_at is not None:
            wait_for(
                lambda: g1.last_step >= sc.kill_at or g1.proc.poll() is not None,
                deadline,
                f"group 1 to reach step {sc.kill_at}",
                job=job,
            )
            job.kill(g1)
            killed_at = g0.last_step
            result["notes"].append(f"SIGKILL group 1 at its step {g1.last_step}")
            # The survivor must go on alone before the restart (or crash trying).
            wait_for(
                lambda: g0.last_step >= killed_at + sc.alone_steps or g0.proc.poll() is not None,
                deadline,
                "group 0 to train alone",
                job=job,
            )
            result["notes"].append(f"restart group 1 when group 0 is at step {g0.last_step}")
            restarted_at = time.time()
            g1b = job.group(sc, 1, 1)
            runs.append(g1b)
        wait_for(
            lambda: all(r.proc.poll() is not None for r in runs),
            deadline,
            "every group to finish",
            job=job,
        )
    except (TimeoutError, RuntimeError) as e:
        result["notes"].append(f"ABORTED: {e}")
    finally:
        job.close()
    result["wall_s"] = round(time.monotonic() - started, 1)
    for r in runs:
        r.parse()
    result["runs"] = [
        {
            "group": r.group,
            "incarnation": r.incarnation,
            "rc": r.proc.returncode,
            "warmup_step": r.warmup_step,
            "first_step": min(r.steps, default=0),
            "last_step": max(r.steps, default=0),
            "first_loss": r.steps[min(r.steps)][0] if r.steps else None,
            "last_loss": r.steps[max(r.steps)][0] if r.steps else None,
            "crash_mixed_dtensor": CRASH_TEXT in r.text(),
            # torchheal only: commits, and those both groups took part in.
            "commits": len(COMMIT_LINE.findall(r.text())),
            "commits_with_2": sum(p == "2" for p in COMMIT_LINE.findall(r.text())),
            "log": str(r.log.relative_to(REPO)) if r.log.is_relative_to(REPO) else str(r.log),
        }
        for r in runs
    ]
    checks = result["checks"]
    final = [
        r for r in runs if not (sc.kill_at is not None and r.group == 1 and r.incarnation == 0)
    ]
    checks["all finish rc 0"] = all(r.proc.returncode == 0 for r in final)
    checks[f"all reach step {sc.steps}"] = all(r.last_step == sc.steps for r in final)
    checks["losses fall"] = all(_falls(r.steps) for r in final)
    if sc.semi_sync is not None and "torchheal" in library_of(job.venv):
        # Each sync is one manager step; both groups must have synced together.
        want = sc.steps // (sc.sync_steps or 1)
        checks[f">= {want} syncs committed with both groups"] = all(
            r["commits_with_2"] >= want for r in result["runs"]
        )
    if sc.semi_sync is None:
        # Per-step: both groups average gradients, so both log the same norm at shared steps.
        both = [r for r in runs if r.group == 0], [r for r in runs if r.group == 1]
        g0_steps = {s: v for r in both[0] for s, v in r.steps.items()}
        g1_steps = {s: v for r in both[1] for s, v in r.steps.items()}
        shared = sorted(set(g0_steps) & set(g1_steps))
        equal = [s for s in shared if g0_steps[s][1] == g1_steps[s][1]]
        result["grad_norm_equal_steps"] = f"{len(equal)}/{len(shared)}"
        result["grad_norm_unequal"] = [
            (s, g0_steps[s][1], g1_steps[s][1]) for s in shared if s not in equal
        ]
        if sc.kill_at is None:
            checks["grad_norm equal at every step"] = bool(shared) and len(equal) == len(shared)
    if sc.kill_at is not None:
        g0, g1b = runs[0], runs[-1]
        alone = [s for s in g0.steps if s > runs[1].last_step and s < min(g1b.steps, default=0)]
        checks["survivor trains alone"] = len(alone) >= 2
        healed = g1b.steps and min(g1b.steps) > sc.kill_at
        checks["restarted group heals live (first step > kill step)"] = bool(healed)
        if healed:
            # With the async quorum the heal is loaded after the first step's forward pass, so
            # that step's loss is the fresh model's; from the next step on it is the survivor's.
            s = min(g1b.steps)
            result["heal_first_step"] = s
            pairs = [
                (g1b.steps[t][0], g0.steps[t][0])
                for t in (s, s + 1)
                if t in g0.steps and t in g1b.steps
            ]
            result["loss_restarted_vs_survivor_at_heal"] = pairs
            checks["healed loss is the survivor's (next step, within 1.0)"] = (
                len(pairs) == 2 and abs(pairs[1][0] - pairs[1][1]) < 1.0
            )
        checks["no crash"] = not any(r.proc.returncode not in (0, -9) for r in runs)
        if restarted_at is not None:
            result["survivor_during_rejoin"] = survivor_during_rejoin(
                g0, runs[1], g1b, restarted_at
            )
    result["passed"] = all(checks.values())
    return result


def survivor_during_rejoin(survivor: Run, killed: Run, restarted: Run, restarted_at: float) -> dict:
    """The survivor's step times while a group rejoins, against its normal step (goal 4).

    A step's time is the gap between its logged line and the previous step's. Normal: the
    survivor's steps 3 and later until the kill, both groups training. The rejoin: the survivor's
    steps that ended after the restart, up to and including the first one that ended after the
    restarted group's second step (its heal step, then its first full step in the quorum):
    the restart's start-up, warm-up and heal all fall inside.
    """
    ended = survivor.ended
    took = {s: ended[s] - ended[s - 1] for s in ended if s - 1 in ended}
    normal = [t for s, t in took.items() if 3 <= s <= killed.last_step]
    joined = sorted(restarted.ended.values())
    if not normal or len(joined) < 2:
        return {"measured": False}
    window = []
    for s in sorted(took):
        if ended[s] > restarted_at:
            window.append(s)
            if ended[s] > joined[1]:
                break
    if not window:
        return {"measured": False}
    longest = max(window, key=lambda s: took[s])
    median = statistics.median(normal)
    return {
        "measured": True,
        "normal_step_s": round(median, 2),
        "steps": [window[0], window[-1]],
        "longest_step": longest,
        "longest_step_s": round(took[longest], 2),
        "ratio": round(took[longest] / median, 2),
    }


def _run_cell(run: dict) -> str:
    crash = " CRASH(mixed Tensor/DTensor)" if run["crash_mixed_dtensor"] else ""
    rc = "killed" if run["rc"] == -9 else f"rc {run['rc']}"
    loss = ""
    if run["first_loss"] is not None:
        loss = f", loss {run['first_loss']:.2f}->{run['last_loss']:.2f}"
    commits = ""
    if run.get("commits"):
        commits = f", {run['commits']} commits ({run['commits_with_2']} with both)"
    return (
        f"g{run['group']}.{run['incarnation']}: {rc}, steps {run['first_step']}-"
        f"{run['last_step']}{loss}{commits}{crash}"
    )


def print_table(paths: list[Path]) -> None:
    """Prints every scenario of the given results.json files side by side (markdown)."""
    print(
        "| library | scenario | wall s | groups (incarnation: exit, steps logged, loss) "
        "| grad_norm equal | survivor's longest step during the rejoin vs normal | checks |"
    )
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        if not path.exists():
            continue
        for res in json.loads(path.read_text()):
            runs = "<br>".join(_run_cell(r) for r in res["runs"])
            failed = [k for k, ok in res["checks"].items() if not ok]
            checks = "all pass" if not failed else "FAIL: " + "; ".join(failed)
            gn = res.get("grad_norm_equal_steps", "-")
            rejoin = res.get("survivor_during_rejoin", {})
            survivor = "-"
            if rejoin.get("measured"):
                survivor = (
                    f"{rejoin['longest_step_s']} s vs {rejoin['normal_step_s']} s "
                    f"({rejoin['ratio']}x)"
                )
            print(
                f"| {res['library']} | {res['scenario']} | {res['wall_s']} | {runs} | {gn} "
                f"| {survivor} | {checks} |"
            )


def check_import_name(venv: Path) -> str:
    """Which library ``import torchft`` gives in ``venv``; for torchheal, also that it is the same
    objects (the compat distribution is an alias, not a copy). Run outside the repository, so
    the checkout's own ``torchheal`` folder is not importable by accident."""
    code = (
        "import torchft, torchft.process_group as p\n"
        "if not torchft.Manager.__module__.startswith('torchheal.'):\n"
        "    print('reference'); raise SystemExit\n"
        "import torchheal\n"
        "assert torchft.Manager is torchheal.Manager\n"
        "assert p is torchheal.process_group\n"
        "print('torchheal')\n"
    )
    out = subprocess.run([venv / "bin/python", "-c", code], capture_output=True, text=True, cwd="/")
    if out.returncode != 0:
        raise RuntimeError(f"`import torchft` fails in {venv}: {out.stderr[-2000:]}")
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", default=".venv-titan")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--deadline_s", type=float, default=420)
    parser.add_argument(
        "--expect_crash",
        action="store_true",
        help="reference mode: report whether the healthy peer crashed",
    )
    parser.add_argument(
        "--table",
        nargs="*",
        metavar="VENV",
        help="only print the results of these venvs' last runs as a table",
    )
    args = parser.parse_args(argv)
    if args.table is not None:
        print_table([REPO / "runs-titan" / Path(v).name / "results.json" for v in args.table])
        return 0
    venv = (REPO / args.venv).resolve()
    names = args.scenario or ["per_step", "diloco", "local_sgd", "kill"]
    out_root = REPO / "runs-titan" / venv.name
    assets = REPO / "runs-titan" / "assets"
    subprocess.run([venv / "bin/python", HERE / "make_assets.py", assets], check=True)
    lib = f"{library_of(venv)} (import torchft -> {check_import_name(venv)})"
    results = []
    for name in names:
        print(f"== {name} ({lib}) ...", flush=True)
        res = run_scenario(SCENARIOS[name], venv, out_root / name, assets, args.deadline_s)
        res["library"] = lib
        results.append(res)
        print(json.dumps(res, indent=1), flush=True)
    (out_root / "results.json").write_text(json.dumps(results, indent=1))
    if args.expect_crash:
        return 0
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
