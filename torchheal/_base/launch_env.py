"""Where a launcher puts this process: torchrun's variables and the replica group's.

* :class:`TorchrunEnv` - where torchrun says this rank's replica group lives.
* :class:`LauncherEnv` - what a launcher tells a replica group (group id, group count, log level,
  whether it began as a warm spare).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchheal._base.env import parse_int, source


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
        """Reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``."""
        env = source(environ)
        # A patched os.environ (a plain dict in tests, the reference's among them) may hold an
        # int such as MASTER_PORT=store.port: read it as the string it stands for.
        values = {field: env.get(field.upper()) for field in _TORCHRUN_MINIMUM}
        return cls(**{f: v if v is None else str(v) for f, v in values.items()})

    def require(self, field: str, argument: str) -> str | int:
        """The value of ``field`` (an int, except ``master_addr``), which must be set.

        ``argument`` names the constructor argument that could have given it. Raises
        ``KeyError`` when unset (as a plain environment lookup would).
        """
        variable = field.upper()
        raw = getattr(self, field)
        if raw is None or raw.strip() == "":
            raise KeyError(f"{variable} is not set: pass {argument}= or run under torchrun")
        minimum = _TORCHRUN_MINIMUM[field]
        return raw.strip() if minimum is None else parse_int(variable, raw.strip(), minimum)


# field -> smallest valid value (None: a host name, not a number)
_TORCHRUN_MINIMUM: dict[str, int | None] = {
    "master_addr": None,
    "master_port": 0,
    "rank": 0,
    "world_size": 1,
}


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
        """Reads and validates the variables."""
        env = source(environ)
        group = env.get("REPLICA_GROUP_ID", "").strip()
        groups = env.get("NUM_REPLICA_GROUPS", "").strip()
        return cls(
            replica_group_id=parse_int("REPLICA_GROUP_ID", group, 0) if group else 0,
            num_replica_groups=parse_int("NUM_REPLICA_GROUPS", groups, 1) if groups else None,
            log_level=env.get("LOGLEVEL", "").strip() or "WARNING",
            warm_spare=env.get(WARM_SPARE_ENV, "") == "1",
        )
