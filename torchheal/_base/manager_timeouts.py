"""The Manager's effective timeouts: its arguments with the environment's overrides, checked.

:class:`ManagerTimeouts` is built once from the constructor's arguments and the parsed
:class:`~torchheal._base.manager_env.EnvConfig` (the environment wins, as in the reference);
:func:`timeout_budget_problems` names the orderings of timeouts under which a peer's failure
would kill this replica instead of healing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from torchheal._base.manager_env import EnvConfig

#: The lighthouse's default heartbeat expiry (reference ``heartbeat_timeout_ms=5000``). The
#: Manager cannot ask the lighthouse for its setting, so the budget check assumes the default.
DEFAULT_LIGHTHOUSE_HEARTBEAT_TIMEOUT = timedelta(milliseconds=5000)


class TimeoutBudgetWarning(UserWarning):
    """Timeouts are ordered so that a peer failure would kill this replica instead of healing it."""


def get_timeout(env_value: str | None, default: timedelta) -> timedelta:
    """Returns the timeout given by an environment value (integer seconds), or ``default``."""
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
        """Applies the environment overrides to the constructor's values, then validates."""

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

    Returns one sentence per problem; empty when the budget is sound.
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
