"""Table of the RPC methods: full path, request and response types.

The reference's ``torchft`` protocol (unary methods) and torchheal's own ``torchheal``
session protocol (streams; see ``session.proto``).

One place names every method, so servers, clients and tests agree on paths without importing
the generated grpc module (see the package docstring for why).
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message

from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb

__all__ = [
    "LIGHTHOUSE_SERVICE",
    "MANAGER_SERVICE",
    "NOTICES_SERVICE",
    "SESSION_PROTOCOL",
    "SESSION_SERVICE",
    "Method",
]


@dataclass(frozen=True)
class Method:
    """One RPC method (unary, or a stream where its service defines one).

    Args:
        service: fully qualified service name, e.g. ``torchft.LighthouseService``.
        name: method name, e.g. ``Quorum``.
        request: protobuf class of the request.
        response: protobuf class of the response.
    """

    service: str
    name: str
    request: type[Message]
    response: type[Message]

    @property
    def path(self) -> str:
        """The HTTP/2 path gRPC sends, ``/{service}/{name}``."""
        return f"/{self.service}/{self.name}"


LIGHTHOUSE_SERVICE = "torchft.LighthouseService"
MANAGER_SERVICE = "torchft.ManagerService"

LIGHTHOUSE_QUORUM = Method(
    LIGHTHOUSE_SERVICE, "Quorum", pb.LighthouseQuorumRequest, pb.LighthouseQuorumResponse
)
LIGHTHOUSE_HEARTBEAT = Method(
    LIGHTHOUSE_SERVICE, "Heartbeat", pb.LighthouseHeartbeatRequest, pb.LighthouseHeartbeatResponse
)
MANAGER_QUORUM = Method(
    MANAGER_SERVICE, "Quorum", pb.ManagerQuorumRequest, pb.ManagerQuorumResponse
)
MANAGER_CHECKPOINT_METADATA = Method(
    MANAGER_SERVICE,
    "CheckpointMetadata",
    pb.CheckpointMetadataRequest,
    pb.CheckpointMetadataResponse,
)
MANAGER_SHOULD_COMMIT = Method(
    MANAGER_SERVICE, "ShouldCommit", pb.ShouldCommitRequest, pb.ShouldCommitResponse
)
MANAGER_KILL = Method(MANAGER_SERVICE, "Kill", pb.KillRequest, pb.KillResponse)

# torchheal's own services (session.proto). Bump SESSION_PROTOCOL on an incompatible change.
#: 2: ``SessionRequest.gave_up`` (a lighthouse of protocol 1 ends a session that sends it).
SESSION_PROTOCOL = 2
SESSION_SERVICE = "torchheal.LighthouseSession"
NOTICES_SERVICE = "torchheal.ManagerNotices"

LIGHTHOUSE_SESSION = Method(SESSION_SERVICE, "Session", spb.SessionRequest, spb.SessionEvent)
LIGHTHOUSE_DESCRIBE = Method(SESSION_SERVICE, "Describe", spb.DescribeRequest, spb.Description)
MANAGER_WATCH = Method(NOTICES_SERVICE, "Watch", spb.WatchRequest, spb.Notice)
MANAGER_GAVE_UP = Method(NOTICES_SERVICE, "ReportGaveUp", spb.GaveUp, spb.GaveUpAck)
