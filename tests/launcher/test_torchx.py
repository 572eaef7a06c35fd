"""The torchx component: its roles, and a real job on torchx's ``local_cwd`` scheduler running
``examples/train_ddp.py`` (a lighthouse role and two groups of two ranks) to success."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torchx.specs as specs

from torchheal.torchx import ddp, hsdp

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _resolved(app: specs.AppDef) -> dict[str, specs.Role]:
    """The roles as local_cwd would run them (macros substituted)."""
    values = specs.macros.Values(
        img_root="", app_id="app", replica_id="0", rank0_env="TORCHX_RANK0_HOST"
    )
    return {role.name: values.apply(role) for role in app.roles}


def test_the_job_is_a_lighthouse_role_then_one_torchrun_per_group() -> None:
    roles = _resolved(hsdp("--lr", "0.1", replicas=3, workers_per_replica=4, master_port=30000))
    assert list(roles) == ["lighthouse", "replica_0", "replica_1", "replica_2"]
    lighthouse = roles["lighthouse"]
    assert lighthouse.args[:3] == ["-m", "torchheal.cli", "lighthouse"]
    assert "--exit_when_idle=60" in lighthouse.args and "--bind=[::]:29510" in lighthouse.args
    for group in range(3):
        role = roles[f"replica_{group}"]
        assert role.num_replicas == 1 and role.entrypoint == "bash"
        assert role.env["REPLICA_GROUP_ID"] == str(group) and role.env["NUM_REPLICA_GROUPS"] == "3"
        assert role.env["CUDA_VISIBLE_DEVICES"] == ""
        command = role.args[1]
        assert "--nproc_per_node=4 " in command and "--nnodes=1 " in command
        assert f"--master_port={30000 + group} " in command
        assert command.endswith("train_ddp.py --lr 0.1")
        # The lighthouse is the job's rank-0 host, unless the environment names one.
        assert (
            'TORCHHEAL_LIGHTHOUSE="${TORCHHEAL_LIGHTHOUSE:-http://${TORCHX_RANK0_HOST:-localhost}'
            ':29510}"' in command
        )


def test_a_given_lighthouse_replaces_the_role_and_gpus_stay_visible() -> None:
    roles = _resolved(ddp(replicas=2, gpu=8, lighthouse="http://lh:29510", script="t.py"))
    assert list(roles) == ["replica_0", "replica_1"]
    assert "CUDA_VISIBLE_DEVICES" not in roles["replica_0"].env
    assert "${TORCHHEAL_LIGHTHOUSE:-http://lh:29510}" in roles["replica_0"].args[1]
    # Arguments reach the script as they were given, through the shell.
    roles = _resolved(hsdp("--name", "a b$c", replicas=1, script="t.py"))
    out = subprocess.run(
        ["bash", "-c", roles["replica_0"].args[1].replace("exec torchrun", "printf '%s\\n'")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[-3:] == ["t.py", "--name", "a b$c"]
    with pytest.raises(ValueError, match="replicas must be > 0"):
        hsdp(replicas=0)


def _free_ports(count: int, consecutive: bool = False) -> list[int]:
    while True:
        socks = []
        try:
            first = socket.socket()
            first.bind(("", 0))
            socks.append(first)
            ports = [first.getsockname()[1]]
            for i in range(1, count):
                s = socket.socket()
                s.bind(("", ports[0] + i if consecutive else 0))
                socks.append(s)
                ports.append(s.getsockname()[1])
            return ports
        except OSError:
            continue  # the next port was taken: try another base
        finally:
            for s in socks:
                s.close()


@pytest.mark.slow
def test_ddp_component_runs_the_example_on_local_cwd(tmp_path: Path) -> None:
    lighthouse_port, dashboard_port = _free_ports(2)
    master_port = _free_ports(2, consecutive=True)[0]
    done = subprocess.run(
        [
            str(BIN / "torchx"),
            "run",
            "-s",
            "local_cwd",
            "-cfg",
            f"log_dir={tmp_path}",
            "torchheal/torchx.py:ddp",
            *("--replicas", "2", "--workers_per_replica", "2"),
            *("--script", "examples/train_ddp.py", "--python", sys.executable),
            *("--lighthouse_port", str(lighthouse_port), "--dashboard_port", str(dashboard_port)),
            *("--master_port", str(master_port), "--idle_exit_s", "4", "--min_replicas", "2"),
            *("--join_timeout_ms", "3000", "--env", "STEPS=20,OMP_NUM_THREADS=1"),
        ],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=int(timedelta(minutes=4).total_seconds()),
        check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    assert "job finished: SUCCEEDED" in log, log[-5000:]
    for group in (0, 1):
        ranks = re.findall(rf"^replica_{group}/0 step 20 loss", log, re.M)
        assert len(ranks) == 2, f"group {group}: {len(ranks)} ranks reached step 20\n{log[-4000:]}"
    # Both groups trained together: a quorum of the two.
    assert re.search(r"new quorum \d+: replica rank \d of 2 \['train_ddp_0:", log), log[-4000:]
    assert "no replica group heard from for 4.0s: the job is over, exiting" in log
