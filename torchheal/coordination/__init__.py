"""Coordination plane: the lighthouse, the per-group manager server, their clients and values.

Same public names as the reference's ``torchft.coordination``. The pure decision logic lives in
``quorum.py``, ``plan.py`` and ``vote.py``; the gRPC shells in ``lighthouse.py``,
``manager_server.py`` and ``client.py``.
"""

from torchheal.coordination.client import LighthouseClient, ManagerClient
from torchheal.coordination.lighthouse import LighthouseServer
from torchheal.coordination.manager_server import ManagerServer
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
