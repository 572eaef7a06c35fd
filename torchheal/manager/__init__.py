"""``torchheal.manager``: the per-step fault-tolerance lifecycle (the reference's public module).

One step is ``start_quorum`` -> forward/backward with ``allreduce`` -> ``should_commit`` (the
replica group's vote: any error anywhere in the group, nobody steps).

Where each job lives:

* ``manager.py`` - :class:`Manager`, the public API and the only writer of the step's state.
* ``build.py`` - wiring the parts below for one Manager.
* ``settings.py`` - constructor arguments merged with the environment, validated once.
* ``endpoints.py`` - the group's TCPStore, manager server (group rank 0) and client.
* ``state.py`` - the user's named state functions and the lock that keeps reads whole.
* ``quorum_thread.py`` - the thread a step's quorum runs on and the future the loop waits for.
* ``quorum_worker.py`` - the quorum thread's work (quorum, reconfiguration, transfer) as data.
* ``recovery.py`` - sending and receiving a state dict through a checkpoint transport.
* ``heal.py`` - a heal on the training thread (settle the transfer, load), and the warm-up.
* ``failfast.py`` - aborting the process group when the lighthouse says a member is lost.
* ``allreduce.py`` - the collective on the wire and the average after it.
* ``step.py`` - the step's error and the collectives the vote must wait for.
* ``salvage.py`` - redoing a step's allreduces when a group dies in it (``salvage_step``).
* ``views.py`` - the reference's test-visible attributes as views of the parts.
* ``telemetry.py`` - the metrics and structured records the Manager reports.
* ``log.py`` - the per-rank log prefix.

``ManagerClient`` is looked up here by ``endpoints.py`` so that tests can patch it, and
``_ManagedWork`` (from ``torchheal.work``) is re-exported for the reference's tests.
"""

from __future__ import annotations

from torchheal._base.manager_env import (
    CONNECT_TIMEOUT_SEC_ENV,
    MANAGER_PORT_ENV,
    QUORUM_RETRIES_ENV,
    QUORUM_TIMEOUT_SEC_ENV,
    TIMEOUT_SEC_ENV,
)
from torchheal._base.manager_timeouts import get_timeout
from torchheal.coordination.clients.manager_client import ManagerClient
from torchheal.coordination.plan import WorldSizeMode
from torchheal.manager.endpoints import MANAGER_ADDR_KEY, REPLICA_ID_KEY
from torchheal.manager.manager import IS_TRITON_AVAILABLE, Manager
from torchheal.manager.step import ExceptionWithTraceback
from torchheal.utils import extract_trailing_digits
from torchheal.work import _ManagedWork

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
    "ManagerClient",
    "WorldSizeMode",
    "_ManagedWork",
    "extract_trailing_digits",
    "get_timeout",
]
