"""Every environment variable torchheal reads, parsed and validated in one place.

No other module of torchheal reads ``os.environ`` (a test reads the import graph to hold this;
the launcher only *passes* an environment to the processes it starts). What is read:

* :class:`EnvConfig` - the Manager's overrides (lighthouse, port, timeouts, retries).
* :class:`TorchrunEnv` - where torchrun says this rank's replica group lives.
* :func:`watchdog_timeout_s` - how long one timeout callback may run (``torchheal.futures``).
* :func:`use_bucketization` - DiLoCo's flat-bucket allreduce switch.
* :func:`checkpoint_token` - the shared secret of the HTTP checkpoint transport.
* :func:`job_token`, :class:`SecurityEnv` - the job token and TLS files of every endpoint.
* :class:`LauncherEnv` - what a launcher tells a replica group (group id, group count, log level).
* :func:`nccl_debug_pipe_prefix` - where NCCL's flight recorder listens for dump requests.
* :class:`TelemetryEnv` - a trainer's metrics port, the job id of its log records, OpenTelemetry.

The reference reads its environment overrides in several places and then forgets to use the
adjusted values in some of them (the checkpoint transport, the state-dict lock and the RPC
clients get the raw constructor arguments). Here the Manager's environment is parsed once into
:class:`EnvConfig`, merged with the constructor arguments into :class:`ManagerTimeouts`, and
that single object is what every component receives.

Every variable has a ``TORCHHEAL_*`` name and the reference's ``TORCHFT_*`` name as a fallback;
the torchheal name wins when both are set. Malformed values raise :class:`ValueError` naming the
variable, so a typo in a launcher script fails at start-up instead of silently using a default.
Each reader takes an optional mapping in place of ``os.environ``, so tests need not patch it.

One torch variable is deliberately *not* written here: ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (how
long NCCL's non-blocking communicators wait on init). torchheal bounds every NCCL operation and
the group's construction with its own timer instead, so the process environment is left to the
user.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

# The reference's names, kept as the public constants of ``torchheal.manager``.
MANAGER_PORT_ENV: str = "TORCHFT_MANAGER_PORT"
TIMEOUT_SEC_ENV: str = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV: str = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV: str = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV: str = "TORCHFT_QUORUM_RETRIES"
LIGHTHOUSE_ENV: str = "TORCHFT_LIGHTHOUSE"

# torchheal name -> reference fallback name, in lookup order.
_ENV_NAMES: dict[str, tuple[str, str]] = {
    "lighthouse": ("TORCHHEAL_LIGHTHOUSE", LIGHTHOUSE_ENV),
    "manager_port": ("TORCHHEAL_MANAGER_PORT", MANAGER_PORT_ENV),
    "timeout_sec": ("TORCHHEAL_TIMEOUT_SEC", TIMEOUT_SEC_ENV),
    "quorum_timeout_sec": ("TORCHHEAL_QUORUM_TIMEOUT_SEC", QUORUM_TIMEOUT_SEC_ENV),
    "connect_timeout_sec": ("TORCHHEAL_CONNECT_TIMEOUT_SEC", CONNECT_TIMEOUT_SEC_ENV),
    "quorum_retries": ("TORCHHEAL_QUORUM_RETRIES", QUORUM_RETRIES_ENV),
    "watchdog_timeout_sec": ("TORCHHEAL_WATCHDOG_TIMEOUT_SEC", "TORCHFT_WATCHDOG_TIMEOUT_SEC"),
    "use_bucketization": ("TORCHHEAL_USE_BUCKETIZATION", "TORCHFT_USE_BUCKETIZATION"),
}

#: The HTTP checkpoint transport's shared secret (torchheal only; the reference has none).
CHECKPOINT_TOKEN_ENV: str = "TORCHHEAL_CHECKPOINT_TOKEN"

#: Seconds one timeout callback may run before the process is declared stuck (reference: 30).
DEFAULT_WATCHDOG_TIMEOUT_S = 30.0

#: The lighthouse's default heartbeat expiry (reference ``heartbeat_timeout_ms=5000``). The
#: Manager cannot ask the lighthouse for its setting, so the budget check assumes the default.
DEFAULT_LIGHTHOUSE_HEARTBEAT_TIMEOUT = timedelta(milliseconds=5000)


class TimeoutBudgetWarning(UserWarning):
    """Timeouts are ordered so that a peer failure would kill this replica instead of healing it."""


def _lookup(environ: Mapping[str, str], field: str) -> tuple[str, str] | None:
    """Returns ``(variable name, raw value)`` for ``field``, torchheal name first."""
    for name in _ENV_NAMES[field]:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def _parse_int(name: str, value: str, minimum: int) -> int:
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
    if parsed < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return parsed


@dataclass(frozen=True)
class EnvConfig:
    """The Manager's environment overrides; ``None`` means the variable is not set.

    Attributes:
        lighthouse: lighthouse address (``TORCHHEAL_LIGHTHOUSE`` / ``TORCHFT_LIGHTHOUSE``).
        manager_port: ManagerServer port (``*_MANAGER_PORT``), 0 means ephemeral.
        timeout_sec: whole seconds overriding ``Manager(timeout=...)`` (``*_TIMEOUT_SEC``).
        quorum_timeout_sec: whole seconds overriding ``quorum_timeout`` (``*_QUORUM_TIMEOUT_SEC``).
        connect_timeout_sec: whole seconds overriding ``connect_timeout`` (``*_CONNECT_TIMEOUT_SEC``).
        quorum_retries: overrides ``quorum_retries`` (``*_QUORUM_RETRIES``).
    """

    lighthouse: str | None = None
    manager_port: int | None = None
    timeout_sec: int | None = None
    quorum_timeout_sec: int | None = None
    connect_timeout_sec: int | None = None
    quorum_retries: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EnvConfig:
        """Reads and validates the overrides.

        Args:
            environ: the environment to read; ``os.environ`` when None.

        Raises:
            ValueError: a variable is set to something that is not a valid value; the message
                names the variable.
        """
        env = _environ(environ)
        values: dict[str, object] = {}
        found = _lookup(env, "lighthouse")
        if found is not None:
            values["lighthouse"] = found[1]
        found = _lookup(env, "manager_port")
        if found is not None:
            port = _parse_int(*found, minimum=0)
            if port > 65535:
                raise ValueError(f"{found[0]}={found[1]!r} is not a valid port")
            values["manager_port"] = port
        for field in ("timeout_sec", "quorum_timeout_sec", "connect_timeout_sec"):
            found = _lookup(env, field)
            if found is not None:
                # Zero would make every operation fail at once; that is never intended.
                values[field] = _parse_int(*found, minimum=1)
        found = _lookup(env, "quorum_retries")
        if found is not None:
            values["quorum_retries"] = _parse_int(*found, minimum=0)
        return cls(**values)  # type: ignore[arg-type]


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


@dataclass(frozen=True)
class TorchrunEnv:
    """Where torchrun (or any launcher using its variables) puts this rank, as raw strings.

    Only the values the Manager's arguments leave open are needed, so each is checked when
    asked for (:meth:`require`), not when read.

    Attributes:
        master_addr: host of the replica group's TCPStore (``MASTER_ADDR``).
        master_port: its port (``MASTER_PORT``).
        rank: this process's rank in its replica group (``RANK``).
        world_size: the replica group's number of ranks (``WORLD_SIZE``).
    """

    master_addr: str | None = None
    master_port: str | None = None
    rank: str | None = None
    world_size: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv:
        """Reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``.

        Args:
            environ: the environment to read; ``os.environ`` when None.
        """
        env = _environ(environ)
        # A patched os.environ (a plain dict in tests, the reference's among them) may hold an
        # int such as MASTER_PORT=store.port: read it as the string it stands for.
        values = {field: env.get(field.upper()) for field in _TORCHRUN_MINIMUM}
        return cls(**{f: v if v is None else str(v) for f, v in values.items()})

    def require(self, field: str, argument: str) -> str | int:
        """The value of ``field`` (an int, except ``master_addr``), which must be set.

        Args:
            field: ``master_addr``, ``master_port``, ``rank`` or ``world_size``.
            argument: the constructor argument that could have given it (for the message).

        Raises:
            KeyError: the variable is not set (as a plain environment lookup would).
            ValueError: a number is malformed; the message names the variable.
        """
        variable = field.upper()
        raw = getattr(self, field)
        if raw is None or raw.strip() == "":
            raise KeyError(f"{variable} is not set: pass {argument}= or run under torchrun")
        minimum = _TORCHRUN_MINIMUM[field]
        return raw.strip() if minimum is None else _parse_int(variable, raw.strip(), minimum)


# field -> smallest valid value (None: a host name, not a number)
_TORCHRUN_MINIMUM: dict[str, int | None] = {
    "master_addr": None,
    "master_port": 0,
    "rank": 0,
    "world_size": 1,
}


def watchdog_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """How long one timeout callback may run before the process is declared stuck.

    ``TORCHHEAL_WATCHDOG_TIMEOUT_SEC`` / ``TORCHFT_WATCHDOG_TIMEOUT_SEC``, default 30 s.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Raises:
        ValueError: the value is not a positive number of seconds.
    """
    found = _lookup(_environ(environ), "watchdog_timeout_sec")
    if found is None:
        return DEFAULT_WATCHDOG_TIMEOUT_S
    name, value = found
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    return seconds


#: ``1``: the Manager salvages the step in flight when a replica group is lost in it.
SALVAGE_STEP_ENV: str = "TORCHHEAL_SALVAGE_STEP"


def salvage_step(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a Manager built with ``salvage_step=None`` salvages the step in flight.

    ``TORCHHEAL_SALVAGE_STEP``: ``1`` turns it on, ``0`` or unset leaves it off (the
    reference has no such setting).

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Raises:
        ValueError: the variable is set to anything else.
    """
    value = _environ(environ).get(SALVAGE_STEP_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SALVAGE_STEP_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


#: The divergence guard: compare the groups' state fingerprints every N committed steps
#: (``0``: off; default 100), and what a mismatch does (``repair``, ``stop`` or ``warn``).
DIVERGENCE_INTERVAL_ENV: str = "TORCHHEAL_DIVERGENCE_CHECK_INTERVAL"
ON_DIVERGENCE_ENV: str = "TORCHHEAL_ON_DIVERGENCE"


def divergence_guard(
    interval: int | None, policy: str | None, environ: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """The divergence guard's ``(interval, policy)``: arguments win, then the environment.

    Args:
        interval: the Manager's ``divergence_check_interval`` (None: the environment's, else
            0: off; 100 is the interval to use).
        policy: the Manager's ``on_divergence`` (None: the environment's, else ``repair``).
        environ: the environment to read; ``os.environ`` when None.

    Raises:
        ValueError: a variable or argument is invalid.
    """
    env = _environ(environ)
    if interval is None:
        text = env.get(DIVERGENCE_INTERVAL_ENV, "0").strip()
        try:
            interval = int(text)
        except ValueError:
            raise ValueError(
                f"{DIVERGENCE_INTERVAL_ENV} must be an integer, got {text!r}"
            ) from None
    if interval < 0:
        raise ValueError(f"divergence check interval must be >= 0 (0: off), got {interval}")
    policy = policy if policy is not None else env.get(ON_DIVERGENCE_ENV, "repair").strip()
    if policy not in ("repair", "stop", "warn"):
        raise ValueError(f"on_divergence must be repair, stop or warn, got {policy!r}")
    return interval, policy


def use_bucketization(environ: Mapping[str, str] | None = None) -> bool:
    """Whether DiLoCo allreduces pseudo-gradients in flat buckets by default.

    ``TORCHHEAL_USE_BUCKETIZATION`` / ``TORCHFT_USE_BUCKETIZATION``; on only for the exact
    string ``True``, as the reference reads it.

    Args:
        environ: the environment to read; ``os.environ`` when None.
    """
    env = _environ(environ)
    for name in _ENV_NAMES["use_bucketization"]:
        value = env.get(name)
        if value is not None:
            return value == "True"
    return False


def checkpoint_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The HTTP checkpoint transport's shared secret, or None.

    ``TORCHHEAL_CHECKPOINT_TOKEN`` (its older, transport-only name) when set, else the job
    token (:func:`job_token`), so one ``TORCHHEAL_TOKEN`` guards the transport too. Either is
    stripped and checked as the job token is.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Raises:
        ValueError: the token has a character outside printable ASCII, or the job token's file
            cannot be read or holds no valid token; the message names the variable.
    """
    env = _environ(environ)
    value = env.get(CHECKPOINT_TOKEN_ENV, "").strip()
    return _checked_token(CHECKPOINT_TOKEN_ENV, value) if value else job_token(env)


#: The job's shared secret, required on every torchheal endpoint when set (docs/security.md).
JOB_TOKEN_ENV: str = "TORCHHEAL_TOKEN"
#: A file holding the job token (kept out of ``ps`` and of the environment of every process).
TOKEN_FILE_ENV: str = "TORCHHEAL_TOKEN_FILE"
#: The lighthouse dashboard's HTTP port (``torchheal lighthouse --dashboard_port``).
DASHBOARD_PORT_ENV: str = "TORCHHEAL_DASHBOARD_PORT"


def job_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The job token: ``TORCHHEAL_TOKEN``, or the contents of ``TORCHHEAL_TOKEN_FILE``.

    Surrounding white space (a file's final newline) is not part of the token. A token is
    printable ASCII without spaces, so that it fits an HTTP header and gRPC metadata as is.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        The token, or None when neither variable is set (or both are blank).

    Raises:
        ValueError: both variables are set, the file cannot be read or is empty, or the token
            has a character outside printable ASCII; the message names the variable.
    """
    env = _environ(environ)
    value = env.get(JOB_TOKEN_ENV, "").strip()
    path = env.get(TOKEN_FILE_ENV, "").strip()
    if value and path:
        raise ValueError(f"set {JOB_TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    name = JOB_TOKEN_ENV
    if path:
        name = f"{TOKEN_FILE_ENV}={path!r}"
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}: cannot read the token file: {e}") from None
        if not value:
            raise ValueError(f"{name}: the token file is empty")
    return _checked_token(name, value) if value else None


def _checked_token(name: str, value: str) -> str:
    # Sent as is in an HTTP header and gRPC metadata: a control character there fails every
    # request (or, inside the value, could split the header), so refuse it at start-up.
    if not all("!" <= c <= "~" for c in value):
        raise ValueError(f"{name}: the token must be printable ASCII without spaces")
    return value


def dashboard_port(environ: Mapping[str, str] | None = None) -> int | None:
    """The dashboard port from ``TORCHHEAL_DASHBOARD_PORT`` (0: any free port), or None.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Raises:
        ValueError: the value is not a port number; the message names the variable.
    """
    value = _environ(environ).get(DASHBOARD_PORT_ENV, "").strip()
    if not value:
        return None
    port = _parse_int(DASHBOARD_PORT_ENV, value, minimum=0)
    if port > 65535:
        raise ValueError(f"{DASHBOARD_PORT_ENV}={value!r} is not a valid port")
    return port


#: Set to "1" by ``torchheal launch`` in the environment of a rank that began as a warm spare.
WARM_SPARE_ENV: str = "TORCHHEAL_WARM_SPARE"


@dataclass(frozen=True)
class LauncherEnv:
    """What a launcher (``torchheal launch``, torchx, Slurm) tells a replica group's processes.

    Attributes:
        replica_group_id: this group's index (``REPLICA_GROUP_ID``, default 0).
        num_replica_groups: how many groups the job has (``NUM_REPLICA_GROUPS``), or None.
        log_level: the logging level name to use (``LOGLEVEL``, default ``WARNING``).
        warm_spare: this process began as a warm spare of ``torchheal launch`` and was handed
            its rank (``TORCHHEAL_WARM_SPARE=1``, set by the launcher).
    """

    replica_group_id: int = 0
    num_replica_groups: int | None = None
    log_level: str = "WARNING"
    warm_spare: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LauncherEnv:
        """Reads and validates the variables.

        Args:
            environ: the environment to read; ``os.environ`` when None.

        Raises:
            ValueError: a number is malformed; the message names the variable.
        """
        env = _environ(environ)
        group = env.get("REPLICA_GROUP_ID", "").strip()
        groups = env.get("NUM_REPLICA_GROUPS", "").strip()
        return cls(
            replica_group_id=_parse_int("REPLICA_GROUP_ID", group, 0) if group else 0,
            num_replica_groups=_parse_int("NUM_REPLICA_GROUPS", groups, 1) if groups else None,
            log_level=env.get("LOGLEVEL", "").strip() or "WARNING",
            warm_spare=env.get(WARM_SPARE_ENV, "") == "1",
        )


#: torch's variable naming the prefix of NCCL's flight-recorder pipes.
NCCL_DEBUG_PIPE_ENV: str = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"


def nccl_debug_pipe_prefix(environ: Mapping[str, str] | None = None) -> str:
    """The prefix of NCCL's flight-recorder pipes (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``), or "".

    Args:
        environ: the environment to read; ``os.environ`` when None.
    """
    return _environ(environ).get(NCCL_DEBUG_PIPE_ENV, "")


def get_timeout(env_value: str | None, default: timedelta) -> timedelta:
    """Returns the timeout given by an environment value, or ``default``.

    Args:
        env_value: the raw variable value (integer seconds) or None when unset.
        default: the timeout to use when the variable is unset.

    Raises:
        ValueError: ``env_value`` is not an integer.
    """
    if env_value is None or env_value.strip() == "":
        return default
    try:
        return timedelta(seconds=int(env_value))
    except ValueError:
        raise ValueError(f"timeout {env_value!r} is not an integer number of seconds") from None


@dataclass(frozen=True)
class ManagerTimeouts:
    """The effective timeouts every Manager component uses (environment applied once).

    Attributes:
        timeout: collectives, should_commit, checkpoint transfer, state-dict lock, wrap_future.
        quorum_timeout: how long a quorum request may wait for the lighthouse.
        connect_timeout: establishing RPC connections (ManagerServer, ManagerClient).
        quorum_retries: lighthouse quorum retries inside the ManagerServer.
    """

    timeout: timedelta
    quorum_timeout: timedelta
    connect_timeout: timedelta
    quorum_retries: int

    @classmethod
    def resolve(
        cls,
        env: EnvConfig,
        timeout: timedelta,
        quorum_timeout: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int,
    ) -> ManagerTimeouts:
        """Applies the environment overrides (environment wins, as in the reference).

        Args:
            env: the parsed environment.
            timeout: the constructor's ``timeout``.
            quorum_timeout: the constructor's ``quorum_timeout``.
            connect_timeout: the constructor's ``connect_timeout``.
            quorum_retries: the constructor's ``quorum_retries``.

        Raises:
            ValueError: a resulting timeout is not positive or retries are negative.
        """

        def pick(sec: int | None, default: timedelta) -> timedelta:
            return default if sec is None else timedelta(seconds=sec)

        resolved = cls(
            timeout=pick(env.timeout_sec, timeout),
            quorum_timeout=pick(env.quorum_timeout_sec, quorum_timeout),
            connect_timeout=pick(env.connect_timeout_sec, connect_timeout),
            quorum_retries=(
                int(quorum_retries) if env.quorum_retries is None else env.quorum_retries
            ),
        )
        resolved.validate()
        return resolved

    def validate(self) -> None:
        """Raises ValueError naming the first field that is out of range."""
        for name in ("timeout", "quorum_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta):
                raise ValueError(f"{name} must be a datetime.timedelta, got {value!r}")
            if value <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {value}")
        if self.quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0, got {self.quorum_retries}")


def timeout_budget_problems(
    timeouts: ManagerTimeouts,
    heartbeat_interval: timedelta,
    lighthouse_heartbeat_timeout: timedelta = DEFAULT_LIGHTHOUSE_HEARTBEAT_TIMEOUT,
) -> list[str]:
    """Lists the orderings of timeouts under which a failure kills a replica instead of healing.

    A quorum error is fatal to the training loop (it is raised, not swallowed), so the quorum
    timeout must outlast everything that can legitimately delay the next quorum after a peer
    dies: the survivors' own collectives timing out (``timeout``) and the lighthouse noticing
    the dead peer's silence (its heartbeat expiry).

    Args:
        timeouts: the effective timeouts.
        heartbeat_interval: how often this replica group heartbeats the lighthouse.
        lighthouse_heartbeat_timeout: the lighthouse's heartbeat expiry (default 5 s).

    Returns:
        one human-readable sentence per problem; empty when the budget is sound.
    """
    problems = []
    if timeouts.quorum_timeout < timeouts.timeout:
        problems.append(
            f"quorum_timeout ({timeouts.quorum_timeout}) < timeout ({timeouts.timeout}): a "
            "survivor can reach the next quorum while its peers still wait out a failed "
            "collective, and its quorum request would time out"
        )
    if timeouts.quorum_timeout <= lighthouse_heartbeat_timeout:
        problems.append(
            f"quorum_timeout ({timeouts.quorum_timeout}) <= the lighthouse heartbeat expiry "
            f"({lighthouse_heartbeat_timeout}): after a peer dies the lighthouse waits for its "
            "heartbeat to expire before issuing a quorum, so survivors would time out"
        )
    if heartbeat_interval >= lighthouse_heartbeat_timeout:
        problems.append(
            f"heartbeat_interval ({heartbeat_interval}) >= the lighthouse heartbeat expiry "
            f"({lighthouse_heartbeat_timeout}): this replica group would look dead while alive"
        )
    return problems


# -- telemetry: trainer metrics, structured logs, OpenTelemetry --------------------------------

#: Port of a replica group's Prometheus ``/metrics`` (group rank 0 only; unset: off).
METRICS_PORT_ENV: str = "TORCHHEAL_METRICS_PORT"
#: Address the trainer's ``/metrics`` listens on (default: every address).
METRICS_HOST_ENV: str = "TORCHHEAL_METRICS_HOST"
#: The job's name in structured log records, as the reference reads it.
JOB_ID_ENV: str = "JOB_ID"
#: The reference's OpenTelemetry switch and resource-attribute file (torchheal names first).
USE_OTEL_ENVS: tuple[str, str] = ("TORCHHEAL_USE_OTEL", "TORCHFT_USE_OTEL")
OTEL_RESOURCE_ATTRIBUTES_JSON_ENVS: tuple[str, str] = (
    "TORCHHEAL_OTEL_RESOURCE_ATTRIBUTES_JSON",
    "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON",
)
_OFF = frozenset({"", "false", "0", "no", "off"})


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The job's name in structured log records (``JOB_ID``, default ``"unknown"``).

    Args:
        environ: the environment to read; ``os.environ`` when None.
    """
    return _environ(environ).get(JOB_ID_ENV, "unknown")


@dataclass(frozen=True)
class TelemetryEnv:
    """What a trainer exports about itself: metrics port, job id, OpenTelemetry.

    Attributes:
        metrics_port: ``TORCHHEAL_METRICS_PORT``: serve ``/metrics`` on group rank 0 at this
            port (0: any free port); None (unset): no metrics server.
        metrics_host: ``TORCHHEAL_METRICS_HOST``: the address it listens on ("" : every one).
        job_id: ``JOB_ID`` (default ``"unknown"``), put in every structured log record.
        use_otel: ``TORCHHEAL_USE_OTEL`` / ``TORCHFT_USE_OTEL``: export the structured log
            records over OpenTelemetry. The reference enables it for any value but ``false``;
            here ``false``, ``0``, ``no``, ``off`` (any case) and empty all mean off.
        otel_resource_attributes_json: ``TORCHHEAL_OTEL_RESOURCE_ATTRIBUTES_JSON`` /
            ``TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON``: a JSON file ``{logger name: {attribute:
            value}}`` of OpenTelemetry resource attributes, or None.
    """

    metrics_port: int | None = None
    metrics_host: str = ""
    job_id: str = "unknown"
    use_otel: bool = False
    otel_resource_attributes_json: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TelemetryEnv:
        """Reads and validates the variables.

        Args:
            environ: the environment to read; ``os.environ`` when None.

        Raises:
            ValueError: the metrics port is not a port number; the message names the variable.
        """
        env = _environ(environ)
        port: int | None = None
        raw = env.get(METRICS_PORT_ENV, "").strip()
        if raw:
            port = _parse_int(METRICS_PORT_ENV, raw, minimum=0)
            if port > 65535:
                raise ValueError(f"{METRICS_PORT_ENV}={raw!r} is not a valid port")
        use_otel = next((env[n] for n in USE_OTEL_ENVS if n in env), "false")
        attributes = next(
            (env[n] for n in OTEL_RESOURCE_ATTRIBUTES_JSON_ENVS if env.get(n, "").strip()), None
        )
        return cls(
            metrics_port=port,
            metrics_host=env.get(METRICS_HOST_ENV, "").strip(),
            job_id=job_id(env),
            use_otel=use_otel.strip().lower() not in _OFF,
            otel_resource_attributes_json=attributes,
        )


# -- security: the job token and TLS on every endpoint (docs/security.md) ----------------------

#: PEM certificate chain a server presents (with :data:`TLS_KEY_ENV`); setting it turns TLS on.
TLS_CERT_ENV: str = "TORCHHEAL_TLS_CERT"
#: PEM private key of that certificate.
TLS_KEY_ENV: str = "TORCHHEAL_TLS_KEY"
#: PEM bundle of the certificate authorities a client trusts; setting it turns TLS on.
TLS_CA_ENV: str = "TORCHHEAL_TLS_CA"
#: ``1``/``true``: ``/metrics`` needs the job token too (default: open, as Prometheus expects).
METRICS_AUTH_ENV: str = "TORCHHEAL_METRICS_AUTH"


@dataclass(frozen=True)
class SecurityEnv:
    """Who may talk to torchheal's endpoints, and over what: read from the environment.

    With nothing set, every endpoint speaks the reference's plain wire (no token, no TLS).

    Attributes:
        token: the job token every server requires and every client sends (:func:`job_token`).
        tls_cert: ``TORCHHEAL_TLS_CERT``: the certificate chain servers present (PEM path).
        tls_key: ``TORCHHEAL_TLS_KEY``: its private key (PEM path).
        tls_ca: ``TORCHHEAL_TLS_CA``: the authorities clients verify servers with (PEM path);
            None with TLS on: the system's default authorities.
        metrics_auth: ``TORCHHEAL_METRICS_AUTH``: ``/metrics`` requires the token as well.
    """

    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    metrics_auth: bool = False

    @property
    def tls(self) -> bool:
        """Whether TLS is on (a certificate or an authority bundle is configured)."""
        return self.tls_cert is not None or self.tls_ca is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SecurityEnv:
        """Reads and validates the variables.

        Args:
            environ: the environment to read; ``os.environ`` when None.

        Raises:
            ValueError: a token problem (see :func:`job_token`), a certificate without its key
                (or the reverse), or a file that does not exist; the message names the variable.
        """
        env = _environ(environ)
        paths: dict[str, str | None] = {}
        for field, name in (
            ("tls_cert", TLS_CERT_ENV),
            ("tls_key", TLS_KEY_ENV),
            ("tls_ca", TLS_CA_ENV),
        ):
            value = env.get(name, "").strip()
            if value and not os.path.isfile(value):
                raise ValueError(f"{name}={value!r}: no such file")
            paths[field] = value or None
        if (paths["tls_cert"] is None) != (paths["tls_key"] is None):
            raise ValueError(f"set {TLS_CERT_ENV} and {TLS_KEY_ENV} together")
        return cls(
            token=job_token(env),
            metrics_auth=env.get(METRICS_AUTH_ENV, "").strip().lower() not in _OFF,
            **paths,
        )


def export_security(
    token_file: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_ca: str | None = None,
) -> SecurityEnv:
    """Put a command line's security flags into this process's environment, and validate.

    The CLIs' ``--token-file``/``--tls-*`` flags land here, so that every server and client the
    command creates reads them, and the processes it starts inherit them (a path, never the
    token itself: it stays out of ``ps``). A flag given replaces the variable; one not given
    leaves it as it is.

    Args:
        token_file: ``--token-file`` (replaces ``TORCHHEAL_TOKEN``, which is then removed).
        tls_cert: ``--tls-cert``.
        tls_key: ``--tls-key``.
        tls_ca: ``--tls-ca``.

    Returns:
        The resulting settings.

    Raises:
        ValueError: the resulting settings are invalid (see :meth:`SecurityEnv.from_env`).
    """
    if token_file is not None:
        os.environ.pop(JOB_TOKEN_ENV, None)
        os.environ[TOKEN_FILE_ENV] = token_file
    for name, value in ((TLS_CERT_ENV, tls_cert), (TLS_KEY_ENV, tls_key), (TLS_CA_ENV, tls_ca)):
        if value is not None:
            os.environ[name] = value
    return SecurityEnv.from_env()
