"""``torchheal.manager``: the per-step fault-tolerance lifecycle (the reference's public module).

The :class:`Manager` lives in ``manager.py``; this module keeps the reference's public names
importable from ``torchheal.manager``.
"""

from __future__ import annotations

from torchheal.manager.manager import (
    CONNECT_TIMEOUT_SEC_ENV,
    IS_TRITON_AVAILABLE,
    MANAGER_ADDR_KEY,
    MANAGER_PORT_ENV,
    QUORUM_RETRIES_ENV,
    QUORUM_TIMEOUT_SEC_ENV,
    REPLICA_ID_KEY,
    TIMEOUT_SEC_ENV,
    ExceptionWithTraceback,
    Manager,
    WorldSizeMode,
    get_timeout,
)

__all__ = [
    "CONNECT_TIMEOUT_SEC_ENV",
    "IS_TRITON_AVAILABLE",
    "MANAGER_ADDR_KEY",
    "MANAGER_PORT_ENV",
    "QUORUM_RETRIES_ENV",
    "QUORUM_TIMEOUT_SEC_ENV",
    "REPLICA_ID_KEY",
    "TIMEOUT_SEC_ENV",
    "ExceptionWithTraceback",
    "Manager",
    "WorldSizeMode",
    "get_timeout",
]
