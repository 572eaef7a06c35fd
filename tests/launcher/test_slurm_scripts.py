"""examples/slurm: the runner and the failure injector against stand-ins of Slurm's tools.

``squeue``, ``sbatch`` and ``scancel`` (and, to run a generated job script, ``scontrol``,
``srun`` and ``torchrun``) are small executables this test writes on ``PATH``: they keep the
cluster's jobs in a JSON file and log every call. The scripts under test run for real.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "examples" / "slurm"

FAKE_SLURM = {
    "squeue": """
        assert "--me" in args and "--format=%i|%j|%T" in args and "--noheader" in args, args
        for job in state["jobs"]:
            print(f"{job['id']}|{job['name']}|{job['state']}")
    """,
    "sbatch": """
        assert args[0] == "--parsable", args
        script = open(args[1]).read()
        name = next(l.split("=", 1)[1] for l in script.splitlines()
                    if l.startswith("#SBATCH --job-name="))
        job_id = str(state["next_id"])
        state["next_id"] += 1
        state["jobs"].append({"id": job_id, "name": name, "state": "PENDING"})
        state.setdefault("scripts", {})[name] = script
        print(job_id)
    """,
    "scancel": """
        state["jobs"] = [j for j in state["jobs"] if j["id"] != args[0]]
        state.setdefault("cancelled", []).append(args[0])
    """,
}


def _write_tools(bin_dir: Path, tools: dict[str, str]) -> None:
    bin_dir.mkdir(exist_ok=True)
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(
            f"#!{sys.executable}\n"
            "import json, os, sys\n"
            "args = sys.argv[1:]\n"
            "path = os.environ['FAKE_SLURM_STATE']\n"
            "state = json.load(open(path))\n"
            f"state.setdefault('calls', []).append([{name!r}, *args])\n"
            + textwrap.dedent(body).strip("\n")
            + "\n"
            + "json.dump(state, open(path, 'w'))\n"
        )
        path.chmod(0o755)


@pytest.fixture
def cluster(tmp_path: Path):
    """A fake Slurm: ``cluster(jobs)`` sets the jobs; ``cluster.state()`` reads everything."""
    bin_dir = tmp_path / "bin"
    _write_tools(bin_dir, FAKE_SLURM)
    state_file = tmp_path / "slurm.json"

    class Cluster:
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_SLURM_STATE": str(state_file),
        }

        def __call__(self, jobs: list[tuple[str, str, str]]) -> None:
            state_file.write_text(
                json.dumps(
                    {"jobs": [{"id": i, "name": n, "state": s} for i, n, s in jobs], "next_id": 900}
                )
            )

        def state(self) -> dict:
            return json.loads(state_file.read_text())

        def run(self, script: str, *args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, str(SLURM_DIR / script), *args],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                cwd=tmp_path,
            )

    return Cluster()


def test_runner_submits_the_groups_that_are_neither_queued_nor_running(cluster, tmp_path) -> None:
    cluster(
        [
            ("11", "torchheal_ft_0", "RUNNING"),
            ("12", "torchheal_ft_1", "PENDING"),  # queued: alive (the reference resubmitted it)
            ("13", "torchheal_ft_2", "COMPLETING"),  # on its way out
            ("14", "torchheal_ft_x", "RUNNING"),  # not one of the groups
            ("15", "other_job", "RUNNING"),
        ]
    )
    args = [
        "--once",
        "--replica-count", "4",
        "--nodes", "2",
        "--nproc-per-node", "4",
        "--gpus-per-node", "4",
        "--lighthouse", "http://head:29510",
        "--workspace-dir", str(tmp_path),
        "--sbatch-arg=--partition=gpu",
        "--", "train.py", "--lr", "0.1", "--name", "a b",
    ]  # fmt: skip
    done = cluster.run("runner.py", *args)
    assert done.returncode == 0, done.stderr
    assert " - group  0: RUNNING (job 11)" in done.stdout
    assert " - group  1: PENDING (job 12)" in done.stdout
    assert " - group  2: DEAD" in done.stdout and " - group  3: DEAD" in done.stdout
    state = cluster.state()
    assert [c[0] for c in state["calls"]] == ["squeue", "sbatch", "sbatch"]
    assert sorted(state["scripts"]) == ["torchheal_ft_2", "torchheal_ft_3"]
    script = state["scripts"]["torchheal_ft_3"]
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "export REPLICA_GROUP_ID=3",
        "export NUM_REPLICA_GROUPS=4",
        "export TORCHHEAL_LIGHTHOUSE=http://head:29510",
    ):
        assert line in script.splitlines(), script
    assert "TORCH_CUDA_SANITIZER=1" not in script

    # Nothing is submitted twice: the new jobs are queued now.
    done = cluster.run("runner.py", *args)
    assert done.returncode == 0 and "DEAD" not in done.stdout, done.stdout
    assert [c[0] for c in cluster.state()["calls"]].count("sbatch") == 2

    # The job script runs torchrun on every node with the group's rendezvous on its first node.
    tools = {
        "scontrol": "print('node7\\nnode8')",
        "srun": "os.execvp(args[1], args[1:])",  # drop --kill-on-bad-exit=1
        "torchrun": "print(json.dumps({'args': args, 'group': os.environ['REPLICA_GROUP_ID'], "
        "'cwd': os.getcwd()}))",
    }
    _write_tools(tmp_path / "bin", tools)
    (tmp_path / "job.sh").write_text(script)
    ran = subprocess.run(
        ["bash", str(tmp_path / "job.sh")],
        env={**cluster.env, "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_JOB_ID": "901"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    torchrun = json.loads(ran.stdout.strip().splitlines()[-1])
    assert torchrun["group"] == "3" and torchrun["cwd"] == str(tmp_path)
    assert torchrun["args"] == [
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node7:29603",
        "--rdzv_id=901",
        "train.py",
        "--lr",
        "0.1",
        "--name",
        "a b",
    ]


def _titan_flags(cluster, *extra: str) -> list[str]:
    cluster([])
    done = cluster.run(
        "runner.py", "--dry-run", "--replica-count", "1", "--lighthouse", "h", *extra
    )
    assert done.returncode == 0, done.stderr
    assert "sbatch" not in [c[0] for c in cluster.state()["calls"]]  # a dry run submits nothing
    return [w for w in done.stdout.split() if w.startswith("--fault_tolerance.")]


def test_runner_semi_sync_switch_is_a_real_boolean(cluster) -> None:
    on = _titan_flags(cluster)
    assert "--fault_tolerance.semi_sync_method=diloco" in on
    assert "--fault_tolerance.num_fragments=2" in on
    off = _titan_flags(cluster, "--no-enable-semi-sync")
    assert not [f for f in off if "semi_sync" in f or "fragment" in f or "sync_steps" in f], off
    local = _titan_flags(cluster, "--semi-sync-method", "local_sgd", "--num-fragments", "5")
    assert "--fault_tolerance.semi_sync_method=local_sgd" in local
    assert not [f for f in local if "fragment" in f], local
    # The reference's type=bool turned "False" into True; here it is not a value at all.
    cluster([])
    done = cluster.run("runner.py", "--once", "--lighthouse", "h", "--enable-semi-sync", "False")
    assert done.returncode == 0 and "sbatch" in [c[0] for c in cluster.state()["calls"]]
    script = cluster.state()["scripts"]["torchheal_ft_0"]
    assert "False" in script  # taken as the command, not as the flag's value


def test_runner_needs_a_lighthouse(cluster) -> None:
    env = {k: v for k, v in cluster.env.items() if "LIGHTHOUSE" not in k}
    done = subprocess.run(
        [sys.executable, str(SLURM_DIR / "runner.py"), "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "give --lighthouse" in done.stderr


def _groups(n: int, state: str = "RUNNING") -> list[tuple[str, str, str]]:
    return [(str(100 + i), f"torchheal_ft_{i}", state) for i in range(n)]


def test_kill_one_cancels_a_running_group_but_never_group_0(cluster) -> None:
    picked = set()
    for seed in range(12):
        cluster([*_groups(4), ("200", "torchheal_ft_9", "PENDING"), ("300", "mine", "RUNNING")])
        done = cluster.run("punisher.py", "--seed", str(seed), "kill_one")
        assert done.returncode == 0, done.stderr
        (cancelled,) = cluster.state()["cancelled"]
        picked.add(cancelled)
    assert picked == {"101", "102", "103"}  # groups 1..3; never 0, the queued one or others


def test_kill_one_without_candidates_says_so(cluster) -> None:
    cluster(_groups(1))
    done = cluster.run("punisher.py", "kill_one")
    assert done.returncode == 0
    assert "no running group to kill" in done.stdout
    assert "cancelled" not in cluster.state()


def test_kill_all_cancels_every_group_and_nothing_else(cluster) -> None:
    cluster([*_groups(2), ("102", "torchheal_ft_2", "PENDING"), ("300", "mine", "RUNNING")])
    done = cluster.run("punisher.py", "kill_all")
    assert done.returncode == 0, done.stderr
    assert sorted(cluster.state()["cancelled"]) == ["100", "101", "102"]


def test_kill_loop_waits_the_random_delays(cluster) -> None:
    sys.path.insert(0, str(SLURM_DIR))
    try:
        import punisher
    finally:
        sys.path.remove(str(SLURM_DIR))
    cluster(_groups(5))
    slept: list[float] = []
    old = dict(os.environ)
    os.environ.update({k: cluster.env[k] for k in ("PATH", "FAKE_SLURM_STATE")})
    try:
        killed = punisher.kill_loop(
            "torchheal_ft", 3, 10.0, random.Random(7), sleep=slept.append, out=lambda s: None
        )
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert len(killed) == 3 and all(k is not None for k in killed)
    assert len(cluster.state()["cancelled"]) == 3
    expected = punisher.delays(3, 10.0, random.Random(7))
    assert slept == expected[:2], "waits after each failure but the last, the random delays"
    assert slept != [10.0, 10.0], "the reference slept the MTBF itself"
    many = punisher.delays(20_000, 10.0, random.Random(1))
    assert min(many) >= 0.0 and max(many) <= 20.0
    assert abs(sum(many) / len(many) - 10.0) < 0.2


def test_kill_loop_from_the_command_line(cluster) -> None:
    cluster(_groups(3))
    done = cluster.run(
        "punisher.py", "--seed", "1", "kill_loop", "--num-failures", "2", "--mtbf-secs", "0.01"
    )
    assert done.returncode == 0, done.stderr
    assert len(cluster.state()["cancelled"]) == 2
    assert done.stdout.count("killing torchheal_ft_") == 2
    bad = cluster.run("punisher.py", "kill_loop", "--mtbf-secs", "0")
    assert bad.returncode == 2 and "--mtbf-secs must be positive" in bad.stderr


def test_a_missing_slurm_is_a_clear_error(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(SLURM_DIR / "punisher.py"), "kill_one"],
        env={**os.environ, "PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "squeue not found: run this on a Slurm login node" in done.stderr
