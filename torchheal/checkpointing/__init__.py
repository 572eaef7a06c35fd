"""Live-recovery checkpoint transports: move a healthy replica's state to a healing one.

Nothing received is unpickled: tensors travel as raw bytes, everything else as a JSON
description that is parsed and validated, with sizes and CRC-32 checksums verified before a
state is returned (see ``serialization``).
"""

from torchheal.checkpointing.http_transport import HTTPTransport
from torchheal.checkpointing.pg_transport import PGTransport
from torchheal.checkpointing.rwlock import RWLock
from torchheal.checkpointing.transport import (
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointTransport,
    TornCheckpointError,
)

__all__ = [
    "CheckpointError",
    "CheckpointTimeoutError",
    "CheckpointTransport",
    "HTTPTransport",
    "PGTransport",
    "RWLock",
    "TornCheckpointError",
]
