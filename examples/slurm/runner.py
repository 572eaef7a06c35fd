#!/usr/bin/env python3
"""Keep N replica groups of a torchheal job alive on Slurm.

Each replica group is one Slurm job (``{prefix}_{i}``: ``--nodes`` nodes, torchrun with
``--nproc-per-node`` ranks on each). Every ``--interval`` seconds the runner lists this user's
jobs and submits again every group that is not queued or running, so a group that died (a
crash, a lost node, ``punisher.py``) comes back and heals live from the others. Run it on a
login node, next to a lighthouse every node can reach::

    torchheal lighthouse --min_replicas 1 --join_timeout_ms 10000 &     # on the head node
    python examples/slurm/runner.py --lighthouse http://head-node:29510 \\
        --replica-count 4 --nodes 1 --nproc-per-node 8 --gpus-per-node 8 \\
        -- examples/train_ddp.py

Without a command after ``--`` it runs torchtitan's trainer with fault tolerance, as the
reference's runner does (``--workspace-dir`` is the torchtitan checkout). ``--dry-run`` prints
the job scripts instead of submitting them; ``--once`` checks once and exits.

Fixed from the reference: a queued (PENDING) group counts as alive (the reference submitted it
again every round); ``--enable-semi-sync`` is a real switch (``--no-enable-semi-sync``; the
reference's ``type=bool`` made every value true) and DiLoCo's flags follow it; no environment
variable named ``TORCH_CUDA_SANITIZER=1``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm import group_jobs, run

# The reference's timeouts for long steps on big clusters (seconds), and its quorum retries.
JOB_ENV = {
    "TORCHFT_QUORUM_TIMEOUT_SEC": "900",
    "TORCHFT_TIMEOUT_SEC": "600",
    "TORCHFT_QUORUM_RETRIES": "0",
    # torchrun's agent shares its rendezvous store with the workers (no start-up race).
    "TORCH_SHARE_RDZV_TCP_STORE": "1",
    "LOGLEVEL": "INFO",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--replica-count",
        "--replicas",
        dest="replica_count",
        type=int,
        default=2,
        help="replica groups to keep alive (default %(default)s)",
    )
    parser.add_argument("--nodes", type=int, default=1, help="nodes per replica group")
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="torchrun ranks on each node (default 1)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs to ask for per node")
    parser.add_argument(
        "--lighthouse",
        default=os.environ.get("TORCHHEAL_LIGHTHOUSE") or os.environ.get("TORCHFT_LIGHTHOUSE"),
        help="the lighthouse every node can reach (default: $TORCHHEAL_LIGHTHOUSE or "
        "$TORCHFT_LIGHTHOUSE)",
    )
    parser.add_argument("--job-prefix", default="torchheal_ft", help="job names: PREFIX_<group>")
    parser.add_argument(
        "--workspace-dir", default=".", help="directory the jobs run in (default: here)"
    )
    parser.add_argument(
        "--interval", type=float, default=10.0, help="seconds between checks (default 10)"
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=29600,
        help="group i's rendezvous port is this plus i (default %(default)s)",
    )
    parser.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra sbatch option, e.g. --sbatch-arg=--partition=gpu (repeatable)",
    )
    parser.add_argument("--once", action="store_true", help="check and submit once, then exit")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the job scripts instead of submitting them"
    )
    titan = parser.add_argument_group("torchtitan (when no command is given)")
    titan.add_argument(
        "--process-group", default="gloo", help="torchtitan's fault_tolerance.process_group"
    )
    titan.add_argument(
        "--enable-semi-sync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train semi-synchronously (default: on)",
    )
    titan.add_argument(
        "--semi-sync-method",
        choices=("diloco", "local_sgd"),
        default="diloco",
        help="the semi-synchronous method (default %(default)s)",
    )
    titan.add_argument(
        "--num-fragments", type=int, default=2, help="DiLoCo fragments (default %(default)s)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training script and args")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    for name in ("replica_count", "nodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.lighthouse:
        parser.error("give --lighthouse (or set TORCHHEAL_LIGHTHOUSE)")
    return args


def torchtitan_command(group: int, args: argparse.Namespace) -> list[str]:
    """torchtitan's trainer with fault tolerance, as the reference's runner starts it.

    Args:
        group: the replica group.
        args: the runner's options.
    """
    command = [
        "./torchtitan/train.py",
        "--job.config_file=./torchtitan/models/llama3/train_configs/llama3_8b.toml",
        "--model.name=llama3_ft",
        "--training.dataset=c4",
        "--training.steps=10000",
        "--training.local_batch_size=2",
        "--metrics.log_freq=1",
        "--comm.train_timeout_seconds=60",
        f"--parallelism.data_parallel_shard_degree={args.nodes * args.nproc_per_node}",
        "--fault_tolerance.enable",
        f"--fault_tolerance.replica_id={group}",
        f"--fault_tolerance.group_size={args.replica_count}",
        f"--fault_tolerance.process_group={args.process_group}",
        f"--fault_tolerance.process_group_timeout_ms={600 * 1000}",
    ]
    if args.enable_semi_sync:
        command.append(f"--fault_tolerance.semi_sync_method={args.semi_sync_method}")
        if args.semi_sync_method == "diloco":
            command += [
                "--fault_tolerance.sync_steps=20",
                "--fault_tolerance.fragment_sync_delay=1",
                f"--fault_tolerance.num_fragments={args.num_fragments}",
            ]
    if group == 0:
        command.append("--checkpoint.interval=100")
    return command


def job_script(group: int, args: argparse.Namespace) -> str:
    """The batch script of one replica group.

    Args:
        group: the replica group.
        args: the runner's options.
    """
    command = args.command or torchtitan_command(group, args)
    env = {
        **JOB_ENV,
        "REPLICA_GROUP_ID": str(group),
        "NUM_REPLICA_GROUPS": str(args.replica_count),
        "TORCHHEAL_LIGHTHOUSE": args.lighthouse,
        "TORCHFT_LIGHTHOUSE": args.lighthouse,  # for code that only knows the reference's name
    }
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={args.job_prefix}_{group}",
        f"#SBATCH --nodes={args.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if args.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    lines += [f"#SBATCH {a}" for a in args.sbatch_arg]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += [
        "# The group's first node hosts torchrun's rendezvous; the other groups reach its",
        "# store there too, so it is advertised by name.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"cd {shlex.quote(str(Path(args.workspace_dir).resolve()))}",
        "exec srun --kill-on-bad-exit=1 torchrun"
        f" --nnodes={args.nodes} --nproc_per_node={args.nproc_per_node}"
        ' --rdzv_backend=c10d --rdzv_endpoint="$head:'
        f'{args.master_port + group}" --rdzv_id="$SLURM_JOB_ID" '
        + " ".join(shlex.quote(c) for c in command),
    ]
    return "\n".join(lines) + "\n"


def submit(group: int, args: argparse.Namespace, script_dir: Path) -> str:
    """Submits one replica group; returns its Slurm job id.

    Args:
        group: the replica group.
        args: the runner's options.
        script_dir: where the batch script is written.
    """
    script_dir.mkdir(parents=True, exist_ok=True)
    path = script_dir / f"{args.job_prefix}_{group}.sbatch"
    path.write_text(job_script(group, args))
    return run(["sbatch", "--parsable", str(path)]).strip().split(";")[0]


def check_once(args: argparse.Namespace, out: Callable[[str], None] = print) -> list[int]:
    """Lists the groups' jobs and submits every group that is not queued or running.

    Args:
        args: the runner's options.
        out: where the report goes.

    Returns:
        The groups submitted.
    """
    alive = group_jobs(args.job_prefix)
    missing = []
    for group in range(args.replica_count):
        jobs = alive.get(group)
        if jobs:
            out(f" - group {group:2d}: {jobs[0].state} (job {jobs[0].job_id})")
        else:
            out(f" - group {group:2d}: DEAD")
            missing.append(group)
    script_dir = Path(args.workspace_dir) / ".torchheal-slurm"
    for group in missing:
        if args.dry_run:
            out(f"would submit group {group}:\n{job_script(group, args)}")
        else:
            out(f"submitted group {group}: job {submit(group, args, script_dir)}")
    return missing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    while True:
        try:
            check_once(args)
        except RuntimeError as e:  # Slurm hiccup: report it and try again next round
            print(f"slurm: {e}", file=sys.stderr, flush=True)
            if args.once:
                return 1
        if args.once or args.dry_run:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    raise SystemExit(main())
