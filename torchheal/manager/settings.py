"""A Manager's settings: its constructor arguments with the environment applied, validated once.

Arguments win over torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``); torchheal's overrides (``TORCHHEAL_*``/``TORCHFT_*`` timeouts, retries, port,
lighthouse) win over arguments, as in the reference. Everything the Manager builds receives
values from one :class:`ManagerSettings`, never from the environment directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from torchheal._base.launch_env import TorchrunEnv
from torchheal._base.manager_env import EnvConfig
from torchheal._base.manager_timeouts import (
    ManagerTimeouts,
    TimeoutBudgetWarning,
    timeout_budget_problems,
)
from torchheal._base.security import SecurityEnv

__all__ = ["ManagerSettings"]


@dataclass(frozen=True)
class ManagerSettings:
    """Where this rank lives and how long things may take.

    Args:
        timeouts: the effective timeouts and quorum retries.
        group_rank: this rank's index in its replica group.
        group_world_size: the replica group's number of ranks.
        store_host: host of the replica group's TCPStore.
        store_port: its port.
        lighthouse_addr: the lighthouse (only group rank 0 needs it).
        port: group rank 0's manager server port (0: ephemeral).
        security: the job token and TLS settings of every endpoint this rank opens or calls
            (its manager server and client, heal metadata requests, the default checkpoint
            transport).
    """

    timeouts: ManagerTimeouts
    group_rank: int
    group_world_size: int
    store_host: str
    store_port: int
    lighthouse_addr: str | None
    port: int
    security: SecurityEnv = field(default_factory=SecurityEnv)

    @classmethod
    def resolve(
        cls,
        *,
        timeout: timedelta,
        quorum_timeout: timedelta,
        connect_timeout: timedelta,
        quorum_retries: int,
        heartbeat_interval: timedelta,
        rank: int | None,
        world_size: int | None,
        store_addr: str | None,
        store_port: int | None,
        lighthouse_addr: str | None,
        port: int | None,
        environ: Mapping[str, str] | None = None,
    ) -> ManagerSettings:
        """Merges the Manager's arguments with the environment.

        Warns with :class:`TimeoutBudgetWarning` when the timeouts are ordered so that a peer
        failure would kill this replica instead of healing it.

        Args:
            timeout: the ``timeout`` argument.
            quorum_timeout: the ``quorum_timeout`` argument.
            connect_timeout: the ``connect_timeout`` argument.
            quorum_retries: the ``quorum_retries`` argument.
            heartbeat_interval: the ``heartbeat_interval`` argument (for the budget check).
            rank: the ``rank`` argument (``RANK`` when None).
            world_size: the ``world_size`` argument (``WORLD_SIZE`` when None or 0).
            store_addr: the ``store_addr`` argument (``MASTER_ADDR`` when None or empty).
            store_port: the ``store_port`` argument (``MASTER_PORT`` when None or 0).
            lighthouse_addr: the ``lighthouse_addr`` argument (``*_LIGHTHOUSE`` when None).
            port: the ``port`` argument (``*_MANAGER_PORT``, else 0, when None).
            environ: the environment to read; ``os.environ`` when None.

        Raises:
            ValueError: a variable or a resulting timeout is invalid.
            KeyError: a torchrun variable is needed but not set.
        """
        env = EnvConfig.from_env(environ)
        timeouts = ManagerTimeouts.resolve(
            env, timeout, quorum_timeout, connect_timeout, quorum_retries
        )
        problems = timeout_budget_problems(timeouts, heartbeat_interval)
        if problems:
            warnings.warn(
                "timeout budget: a failure may kill this replica instead of healing it: "
                + "; ".join(problems),
                TimeoutBudgetWarning,
                stacklevel=3,  # the user's Manager(...) call
            )
        torchrun = TorchrunEnv.from_env(environ)
        return cls(
            timeouts=timeouts,
            group_rank=int(rank if rank is not None else torchrun.require("rank", "rank")),
            group_world_size=int(world_size or torchrun.require("world_size", "world_size")),
            store_host=str(store_addr or torchrun.require("master_addr", "store_addr")),
            store_port=int(store_port or torchrun.require("master_port", "store_port")),
            lighthouse_addr=lighthouse_addr or env.lighthouse,
            port=port if port is not None else (env.manager_port or 0),
            security=SecurityEnv.from_env(environ),
        )
