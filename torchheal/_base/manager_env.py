"""What a trainer's Manager and its algorithms read from the environment, parsed and validated.

* :class:`EnvConfig` - the Manager's overrides (lighthouse, port, timeouts, retries).
* :func:`salvage_step`, :func:`divergence_guard` - the Manager's optional step rules.
* :func:`watchdog_timeout_s` - how long one timeout callback may run (``torchheal.futures``).
* :func:`use_bucketization` - DiLoCo's flat-bucket allreduce switch.

Unlike the reference, which reads overrides in several places, the environment is parsed once
into :class:`EnvConfig`, merged into ``ManagerTimeouts``, and passed to every component.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchheal._base.env import lookup, parse_int, parse_port, source

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

#: Seconds one timeout callback may run before the process is declared stuck (reference: 30).
DEFAULT_WATCHDOG_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class EnvConfig:
    """The Manager's environment overrides (timeouts in whole seconds); ``None``: not set.

    Attributes:
        lighthouse: lighthouse address (``TORCHHEAL_LIGHTHOUSE`` / ``TORCHFT_LIGHTHOUSE``).
        manager_port: ManagerServer port (``*_MANAGER_PORT``), 0 means ephemeral.
        timeout_sec: overrides ``Manager(timeout=...)`` (``*_TIMEOUT_SEC``).
        quorum_timeout_sec: overrides ``quorum_timeout`` (``*_QUORUM_TIMEOUT_SEC``).
        connect_timeout_sec: overrides ``connect_timeout`` (``*_CONNECT_TIMEOUT_SEC``).
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
        """Reads and validates the overrides."""
        env = source(environ)
        values: dict[str, object] = {}
        found = lookup(env, _ENV_NAMES["lighthouse"])
        if found is not None:
            values["lighthouse"] = found[1]
        found = lookup(env, _ENV_NAMES["manager_port"])
        if found is not None:
            values["manager_port"] = parse_port(*found)
        for field in ("timeout_sec", "quorum_timeout_sec", "connect_timeout_sec"):
            found = lookup(env, _ENV_NAMES[field])
            if found is not None:
                # Zero would make every operation fail at once; that is never intended.
                values[field] = parse_int(*found, minimum=1)
        found = lookup(env, _ENV_NAMES["quorum_retries"])
        if found is not None:
            values["quorum_retries"] = parse_int(*found, minimum=0)
        return cls(**values)  # type: ignore[arg-type]


def watchdog_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """How long one timeout callback may run before the process is declared stuck.

    ``TORCHHEAL_WATCHDOG_TIMEOUT_SEC`` / ``TORCHFT_WATCHDOG_TIMEOUT_SEC``, default 30 s.
    """
    found = lookup(source(environ), _ENV_NAMES["watchdog_timeout_sec"])
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

    ``TORCHHEAL_SALVAGE_STEP``: ``1`` turns it on, ``0`` or unset leaves it off.
    """
    value = source(environ).get(SALVAGE_STEP_ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SALVAGE_STEP_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


#: The divergence guard: compare the groups' state fingerprints every N committed steps
#: (``0``: off; default 100), and what a mismatch does (``repair``, ``stop`` or ``warn``).
DIVERGENCE_INTERVAL_ENV: str = "TORCHHEAL_DIVERGENCE_CHECK_INTERVAL"
ON_DIVERGENCE_ENV: str = "TORCHHEAL_ON_DIVERGENCE"


def divergence_guard(
    interval: int | None,
    policy: str | None,
    environ: Mapping[str, str] | None = None,
    default_interval: int = 0,
) -> tuple[int, str]:
    """The divergence guard's ``(interval, policy)``: arguments win, then the environment.

    ``interval`` (0: off) falls back to ``default_interval``, ``policy`` to ``repair``.
    """
    env = source(environ)
    if interval is None:
        text = env.get(DIVERGENCE_INTERVAL_ENV, str(default_interval)).strip()
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
    """
    env = source(environ)
    for name in _ENV_NAMES["use_bucketization"]:
        value = env.get(name)
        if value is not None:
            return value == "True"
    return False
