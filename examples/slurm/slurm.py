"""What runner.py and punisher.py share: Slurm's command-line tools and the replica groups' jobs.

Each replica group is one Slurm job named ``{prefix}_{i}`` (``i`` is the group's
``REPLICA_GROUP_ID``). The scripts talk to Slurm only through ``squeue``, ``sbatch`` and
``scancel`` (found on ``PATH``), so they need no Python package beyond the standard library.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

#: squeue states in which a job is, or will be, a live replica group (COMPLETING is on its way
#: out; anything squeue no longer lists is gone).
ALIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}
)


@dataclass(frozen=True)
class Job:
    """One of this user's Slurm jobs, as squeue lists it.

    Args:
        job_id: Slurm's job id.
        name: the job name.
        state: squeue's state (``RUNNING``, ``PENDING``, ...).
    """

    job_id: str
    name: str
    state: str

    def group(self, prefix: str) -> int | None:
        """The replica group this job runs (None: not one of this job's groups).

        Args:
            prefix: the groups' job-name prefix.
        """
        m = re.fullmatch(rf"{re.escape(prefix)}_(\d+)", self.name)
        return int(m.group(1)) if m else None


def run(argv: Sequence[str]) -> str:
    """Runs a Slurm command and returns its output.

    Args:
        argv: the command.

    Raises:
        RuntimeError: it failed; the message has its error output.
    """
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError:
        raise RuntimeError(f"{argv[0]} not found: run this on a Slurm login node") from None
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout}"
        )
    return done.stdout


def list_jobs() -> list[Job]:
    """This user's jobs (``squeue --me``)."""
    out = run(["squeue", "--me", "--noheader", "--format=%i|%j|%T"])
    jobs = []
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            jobs.append(Job(*(p.strip() for p in parts)))
    return jobs


def group_jobs(prefix: str, states: frozenset[str] = ALIVE_STATES) -> dict[int, list[Job]]:
    """This job's replica-group jobs in one of ``states``, by group.

    Args:
        prefix: the groups' job-name prefix.
        states: the squeue states to keep.
    """
    groups: dict[int, list[Job]] = {}
    for job in list_jobs():
        group = job.group(prefix)
        if group is not None and job.state in states:
            groups.setdefault(group, []).append(job)
    return groups


def cancel(job: Job) -> None:
    """Cancels ``job`` (``scancel``).

    Args:
        job: the job.
    """
    run(["scancel", job.job_id])
