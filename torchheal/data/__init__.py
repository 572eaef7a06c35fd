"""Data for fault-tolerant training: the exactly-once data plan, and the reference's sampler.

* ``DataPlan`` / ``share`` (``plan.py``, pure): which samples each rank reads in a step, as a
  function of the step and its quorum: every sample once, an optional constant global batch.
* ``StepLoader`` (``loader.py``): a step's share through a ``torch.utils.data.DataLoader``.
* ``WindowGuard`` (``guard.py``): the same for LocalSGD/DiLoCo windows.
* ``DistributedSampler`` (``sampler.py``): the reference's per-group shard (lossy on failure).

See ``docs/data.md``.
"""

from torchheal.data.guard import StaleWindowError, WindowGuard
from torchheal.data.loader import StepBatch, StepLoader, StepSource
from torchheal.data.order import Order
from torchheal.data.plan import (
    DataPlan,
    Share,
    StepKey,
    next_key,
    positions,
    share,
    step_indices,
)
from torchheal.data.sampler import DistributedSampler

__all__ = [
    "DataPlan",
    "DistributedSampler",
    "Order",
    "Share",
    "StaleWindowError",
    "StepBatch",
    "StepKey",
    "StepLoader",
    "StepSource",
    "WindowGuard",
    "next_key",
    "positions",
    "share",
    "step_indices",
]
