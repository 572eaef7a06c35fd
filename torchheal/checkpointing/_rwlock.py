"""The reference's module path of the state-dict lock (``torchft.checkpointing._rwlock``).

The implementation lives in :mod:`torchheal.checkpointing.rwlock`; this module only makes the
reference's import path resolve to the same class.
"""

from torchheal.checkpointing.rwlock import RWLock

__all__ = ["RWLock"]
