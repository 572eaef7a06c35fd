"""TorchX components for fault-tolerant jobs: a lighthouse plus N replica groups of K ranks.

Run a local job (``local_cwd`` runs every role on this machine)::

    torchx run -s local_cwd torchheal/torchx.py:ddp --replicas 2 --workers_per_replica 2 \\
        --script examples/train_ddp.py

With ``-s slurm`` or ``-s kubernetes`` every role is a separate allocation. Roles:

* ``lighthouse`` (first, unless ``--lighthouse`` names a running one): it exits once every group
  has been silent for ``idle_exit_s``, so the job ends when training does.
* ``replica_{i}``: one torchrun of ``workers_per_replica`` ranks running ``script``, restarted up
  to ``max_restarts`` times, with ``REPLICA_GROUP_ID=i``, ``NUM_REPLICA_GROUPS=replicas`` and
  ``TORCHHEAL_LIGHTHOUSE`` pointing at the first role's host (resolved by the role's shell).

Each group's TCPStore listens on ``master_port + i``, advertised under ``$(hostname -f)``,
because the other groups connect to it to build the cross-group process group.

Deliberate differences from the reference's ``torchft.torchx.hsdp``:

* the lighthouse is a role of the job (the reference needs one started by hand);
* a group of K ranks is one torchrun of K processes (the reference starts K torchruns);
* GPUs stay visible when ``gpu > 0`` (the reference always sets ``CUDA_VISIBLE_DEVICES=""``).
"""

# No "from __future__ import annotations": torchx reads the component's annotations as types.
import shlex

import torchx.specs as specs

__all__ = ["ddp", "hsdp"]

# What the lighthouse role takes from the user's environment: its log level, and the job's
# token and TLS settings (docs/security.md), which every replica role gets with the rest.
_LIGHTHOUSE_ENV = (
    "LOGLEVEL",
    "TORCHHEAL_TOKEN",
    "TORCHHEAL_TOKEN_FILE",
    "TORCHHEAL_TLS_CERT",
    "TORCHHEAL_TLS_KEY",
    "TORCHHEAL_TLS_CA",
    "TORCHHEAL_METRICS_AUTH",
)

#: The lighthouse's address in a replica role, resolved by the role's shell at start-up.
_LIGHTHOUSE_FROM_RANK0 = "http://$${{{rank0}:-localhost}}:{port}"


def _lighthouse_role(
    image: str,
    python: str,
    min_replicas: int,
    lighthouse_port: int,
    dashboard_port: int,
    join_timeout_ms: int,
    idle_exit_s: int,
    env: dict[str, str],
) -> specs.Role:
    return specs.Role(
        name="lighthouse",
        image=image,
        entrypoint=python,
        args=[
            "-m",
            "torchheal.cli",
            "lighthouse",
            f"--min_replicas={min_replicas}",
            f"--bind=[::]:{lighthouse_port}",
            f"--dashboard_port={dashboard_port}",
            f"--join_timeout_ms={join_timeout_ms}",
            f"--exit_when_idle={idle_exit_s}",
        ],
        num_replicas=1,
        max_retries=0,
        resource=specs.resource(cpu=1, gpu=0, memMB=512),
        env=dict(env),
        port_map={"lighthouse": lighthouse_port, "dashboard": dashboard_port},
    )


def _replica_command(
    group: int,
    workers_per_replica: int,
    max_restarts: int,
    master_port: int,
    script: str,
    script_args: list[str],
    lighthouse: str,
) -> str:
    # "$$" is a literal "$" for torchx's macro substitution; the shell expands the rest.
    torchrun = [
        "torchrun",
        "--nnodes=1",
        f"--nproc_per_node={workers_per_replica}",
        f"--max_restarts={max_restarts}",
        "--rdzv_backend=static",
        f"--master_port={master_port + group}",
        *[shlex.quote(a).replace("$", "$$") for a in (script, *script_args)],
    ]
    return (
        f'export TORCHHEAL_LIGHTHOUSE="$${{TORCHHEAL_LIGHTHOUSE:-{lighthouse}}}"; '
        f'exec {torchrun[0]} --master_addr="$$(hostname -f 2>/dev/null || hostname)" '
        f"{' '.join(torchrun[1:])}"
    )


def hsdp(
    *script_args: str,
    replicas: int = 2,
    workers_per_replica: int = 1,
    max_restarts: int = 10,
    script: str = "train_ddp.py",
    env: dict[str, str] | None = None,
    image: str = "",
    h: str | None = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    lighthouse: str | None = None,
    min_replicas: int = 1,
    lighthouse_port: int = 29510,
    dashboard_port: int = 29511,
    join_timeout_ms: int = 10000,
    idle_exit_s: int = 60,
    master_port: int = 29600,
    python: str = "python",
) -> specs.AppDef:
    """A fault-tolerant job: a lighthouse and ``replicas`` torchrun groups of ``workers_per_replica``.

    Args:
        script_args: arguments passed to the training script.
        replicas: number of replica groups.
        workers_per_replica: ranks per replica group (torchrun's ``--nproc_per_node``).
        max_restarts: how often torchrun restarts a failed group.
        script: the training script each rank runs.
        env: extra environment of every replica role.
        image: the container image (or, for ``local_cwd``, unused).
        h: a named resource of the scheduler for each replica role.
        cpu: CPUs of each replica role.
        gpu: GPUs of each replica role (with 0, CUDA and XPU devices are hidden).
        memMB: memory of each replica role, in MB.
        lighthouse: an already running lighthouse (``http://host:port``); None: the job runs its
            own as its first role.
        min_replicas: the lighthouse's ``min_replicas``.
        lighthouse_port: the lighthouse role's port.
        dashboard_port: the lighthouse role's dashboard port.
        join_timeout_ms: the lighthouse role's ``join_timeout_ms`` (longer than a step).
        idle_exit_s: the lighthouse role exits once no group was heard from for this long.
        master_port: group i's TCPStore listens on ``master_port + i``.
        python: the interpreter that runs the lighthouse role.

    Returns:
        The job's ``AppDef`` (name ``torchheal``).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be > 0, got {replicas}")
    if workers_per_replica < 1:
        raise ValueError(f"workers_per_replica must be > 0, got {workers_per_replica}")
    env = dict(env or {})
    env.setdefault("LOGLEVEL", "INFO")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "INFO")
    if gpu == 0:  # a CPU-only job must not grab an accelerator that happens to be there
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
        env.setdefault("XPU_VISIBLE_DEVICES", "")
    given = lighthouse or env.get("TORCHHEAL_LIGHTHOUSE") or env.get("TORCHFT_LIGHTHOUSE")

    roles = []
    if given:
        address = given
    else:
        address = _LIGHTHOUSE_FROM_RANK0.format(rank0=specs.macros.rank0_env, port=lighthouse_port)
        roles.append(
            _lighthouse_role(
                image,
                python,
                min_replicas,
                lighthouse_port,
                dashboard_port,
                join_timeout_ms,
                idle_exit_s,
                {k: v for k, v in env.items() if k in _LIGHTHOUSE_ENV},
            )
        )
    for group in range(replicas):
        roles.append(
            specs.Role(
                name=f"replica_{group}",
                image=image,
                entrypoint="bash",
                args=[
                    "-c",
                    _replica_command(
                        group,
                        workers_per_replica,
                        max_restarts,
                        master_port,
                        script,
                        list(script_args),
                        address.replace("$", "$$") if given else address,
                    ),
                ],
                num_replicas=1,
                min_replicas=1,
                max_retries=0,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                env={
                    **env,
                    "REPLICA_GROUP_ID": str(group),
                    "NUM_REPLICA_GROUPS": str(replicas),
                },
                port_map={"c10d": master_port + group},
            )
        )
    return specs.AppDef(name="torchheal", roles=roles)


def ddp(
    *script_args: str,
    replicas: int = 2,
    workers_per_replica: int = 1,
    max_restarts: int = 10,
    script: str = "train_ddp.py",
    env: dict[str, str] | None = None,
    image: str = "",
    h: str | None = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    lighthouse: str | None = None,
    min_replicas: int = 1,
    lighthouse_port: int = 29510,
    dashboard_port: int = 29511,
    join_timeout_ms: int = 10000,
    idle_exit_s: int = 60,
    master_port: int = 29600,
    python: str = "python",
) -> specs.AppDef:
    """Fault-tolerant DDP: the same job as :func:`hsdp` (the script decides how it shards).

    Args:
        script_args: arguments passed to the training script.
        replicas: number of replica groups.
        workers_per_replica: ranks per replica group (torchrun's ``--nproc_per_node``).
        max_restarts: how often torchrun restarts a failed group.
        script: the training script each rank runs.
        env: extra environment of every replica role.
        image: the container image (or, for ``local_cwd``, unused).
        h: a named resource of the scheduler for each replica role.
        cpu: CPUs of each replica role.
        gpu: GPUs of each replica role (with 0, CUDA and XPU devices are hidden).
        memMB: memory of each replica role, in MB.
        lighthouse: an already running lighthouse (``http://host:port``); None: the job runs its
            own as its first role.
        min_replicas: the lighthouse's ``min_replicas``.
        lighthouse_port: the lighthouse role's port.
        dashboard_port: the lighthouse role's dashboard port.
        join_timeout_ms: the lighthouse role's ``join_timeout_ms`` (longer than a step).
        idle_exit_s: the lighthouse role exits once no group was heard from for this long.
        master_port: group i's TCPStore listens on ``master_port + i``.
        python: the interpreter that runs the lighthouse role.

    Returns:
        The job's ``AppDef`` (name ``torchheal``).
    """
    return hsdp(
        *script_args,
        replicas=replicas,
        workers_per_replica=workers_per_replica,
        max_restarts=max_restarts,
        script=script,
        env=env,
        image=image,
        h=h,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        lighthouse=lighthouse,
        min_replicas=min_replicas,
        lighthouse_port=lighthouse_port,
        dashboard_port=dashboard_port,
        join_timeout_ms=join_timeout_ms,
        idle_exit_s=idle_exit_s,
        master_port=master_port,
        python=python,
    )
