"""The reference's module path of the state-dict lock (``torchft.checkpointing._rwlock``)."""

from torchheal.checkpointing.rwlock import RWLock

__all__ = ["RWLock"]
