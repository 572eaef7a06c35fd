"""Coordination plane: the lighthouse, the per-group manager server, their clients and values.

Same public names as the reference's ``torchft.coordination``. The pure decisions sit at this
package's root (``quorum.py``, ``plan.py``, ``vote.py``, ``round.py``, ``standing.py``) beside
the value types, ``convert.py`` and ``rpc/``; each program has a sub-package around them:
``lighthouse/``, ``group/`` (a replica group's manager server) and ``clients/``.
"""

from torchheal.coordination.clients.lighthouse_client import LighthouseClient
from torchheal.coordination.clients.manager_client import ManagerClient
from torchheal.coordination.group.server import ManagerServer
from torchheal.coordination.lighthouse.server import LighthouseServer
from torchheal.coordination.types import Quorum, QuorumMember, QuorumResult, Timestamp

__all__ = [
    "LighthouseClient",
    "LighthouseServer",
    "ManagerClient",
    "ManagerServer",
    "Quorum",
    "QuorumMember",
    "QuorumResult",
    "Timestamp",
]
